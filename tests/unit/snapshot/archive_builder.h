// Test helpers: tar archives written with libarchive into the test's own temp dir, and that temp dir.
#pragma once

#include <archive.h>
#include <archive_entry.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "snapshot/layer_store.h"
#include "tests/unit/temp_dir.h"

namespace sg::snapshot::testing {

using sg::testing::TempDir;

struct Entry {
  enum class Kind { kFile, kDir, kSymlink, kHardlink } kind = Kind::kFile;
  std::string path;
  std::string content;  // file data, or the link target
};

inline Entry file(std::string path, std::string content) { return {Entry::Kind::kFile, std::move(path), std::move(content)}; }
inline Entry dir(std::string path) { return {Entry::Kind::kDir, std::move(path), ""}; }
inline Entry symlink(std::string path, std::string target) {
  return {Entry::Kind::kSymlink, std::move(path), std::move(target)};
}
inline Entry hardlink(std::string path, std::string target) {
  return {Entry::Kind::kHardlink, std::move(path), std::move(target)};
}

// Writes `entries` as a tar (gzip-compressed if `gzip`) to `path`; returns false if libarchive refused.
inline bool write_tar(const std::string& path, const std::vector<Entry>& entries, bool gzip = false) {
  archive* a = archive_write_new();
  archive_write_set_format_pax_restricted(a);
  if (gzip) archive_write_add_filter_gzip(a);
  if (archive_write_open_filename(a, path.c_str()) != ARCHIVE_OK) {
    archive_write_free(a);
    return false;
  }
  bool ok = true;
  for (const Entry& e : entries) {
    archive_entry* ae = archive_entry_new();
    archive_entry_set_pathname(ae, e.path.c_str());
    archive_entry_set_mtime(ae, 1'700'000'000, 0);
    switch (e.kind) {
      case Entry::Kind::kFile:
        archive_entry_set_filetype(ae, AE_IFREG);
        archive_entry_set_perm(ae, 0644);
        archive_entry_set_size(ae, static_cast<la_int64_t>(e.content.size()));
        break;
      case Entry::Kind::kDir:
        archive_entry_set_filetype(ae, AE_IFDIR);
        archive_entry_set_perm(ae, 0755);
        break;
      case Entry::Kind::kSymlink:
        archive_entry_set_filetype(ae, AE_IFLNK);
        archive_entry_set_perm(ae, 0777);
        archive_entry_set_symlink(ae, e.content.c_str());
        break;
      case Entry::Kind::kHardlink:
        archive_entry_set_filetype(ae, AE_IFREG);
        archive_entry_set_perm(ae, 0644);
        archive_entry_set_hardlink(ae, e.content.c_str());
        break;
    }
    ok = ok && archive_write_header(a, ae) == ARCHIVE_OK;
    if (e.kind == Entry::Kind::kFile && !e.content.empty())
      ok = ok && archive_write_data(a, e.content.data(), e.content.size()) == static_cast<la_ssize_t>(e.content.size());
    archive_entry_free(ae);
  }
  ok = archive_write_close(a) == ARCHIVE_OK && ok;
  archive_write_free(a);
  return ok;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_file(const std::string& path, const std::string& data) {
  std::ofstream(path, std::ios::binary) << data;
}

inline std::string digest_of(const std::string& path) {
  auto d = sha256_file(path);
  return d ? *d : std::string();
}

}  // namespace sg::snapshot::testing
