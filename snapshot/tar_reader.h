// Reading a tar with libarchive, entry by entry, for both the layer store (a layer) and image import (the outer
// archive): any compression libarchive knows, tar formats only, a bound on the entries, errors naming `label`.
#pragma once

#include <archive.h>
#include <archive_entry.h>

#include <cstdint>
#include <memory>
#include <string>

#include "common/error.h"

namespace sg::snapshot {

class TarReader {
 public:
  // kInvalidArgument "<label>: not a readable tar: ..." when libarchive cannot start on it.
  static Result<TarReader> open(const std::string& path, std::string label, uint64_t max_entries);

  // The next entry (valid until the next call), nullptr at the end. kInvalidArgument for a damaged archive,
  // kLimitExceeded past max_entries.
  Result<archive_entry*> next();
  archive* get() const { return a_.get(); }
  // libarchive's last error on `a`, never null.
  static std::string message(archive* a);

 private:
  struct Free {
    void operator()(archive* a) const { archive_read_free(a); }
  };
  TarReader(std::unique_ptr<archive, Free> a, std::string label, uint64_t max)
      : a_(std::move(a)), label_(std::move(label)), max_entries_(max) {}

  std::unique_ptr<archive, Free> a_;
  std::string label_;
  uint64_t max_entries_;
  uint64_t entries_ = 0;
};

}  // namespace sg::snapshot
