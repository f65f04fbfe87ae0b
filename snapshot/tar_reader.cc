#include "snapshot/tar_reader.h"

namespace sg::snapshot {

namespace {
constexpr size_t kReadBlock = 64 * 1024;
}

std::string TarReader::message(archive* a) {
  const char* m = archive_error_string(a);
  return m != nullptr ? m : "unknown libarchive error";
}

Result<TarReader> TarReader::open(const std::string& path, std::string label, uint64_t max_entries) {
  std::unique_ptr<archive, Free> a(archive_read_new());
  if (!a) return fail(Error::kInternal, "libarchive: out of memory");
  archive_read_support_filter_all(a.get());  // gzip, zstd, xz, bzip2 or none
  archive_read_support_format_tar(a.get());
  if (archive_read_open_filename(a.get(), path.c_str(), kReadBlock) != ARCHIVE_OK)
    return fail(Error::kInvalidArgument, label + ": not a readable tar: " + message(a.get()));
  return TarReader(std::move(a), std::move(label), max_entries);
}

Result<archive_entry*> TarReader::next() {
  archive_entry* e = nullptr;
  int r = archive_read_next_header(a_.get(), &e);
  if (r == ARCHIVE_EOF) return static_cast<archive_entry*>(nullptr);
  if (r < ARCHIVE_WARN) return fail(Error::kInvalidArgument, label_ + ": not a readable tar: " + message(a_.get()));
  if (++entries_ > max_entries_)
    return fail(Error::kLimitExceeded, label_ + ": more than " + std::to_string(max_entries_) + " entries");
  return e;
}

}  // namespace sg::snapshot
