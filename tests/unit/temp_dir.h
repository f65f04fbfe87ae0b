// A directory of the test's own under $TMPDIR (or /tmp), removed with everything in it when the test ends.
// Shared by every unit-test binary.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <string>

namespace sg::testing {

class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "sg-test") {
    std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
    path_ = ::mkdtemp(tmpl.data()) ? tmpl : std::string();
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace sg::testing
