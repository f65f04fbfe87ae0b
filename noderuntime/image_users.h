// Which sandboxes use which image, so `image rm` of an image a sandbox's root filesystem comes from is
// refused (409 naming the sandbox). The node's loop adds and removes users as sandboxes come and go;
// ImageStore::remove asks from a libuv pool thread, hence the lock.
#pragma once

#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>

namespace sg {

class ImageUsers {
 public:
  // `user` is how the refusal names it ("sandbox box (sb-...)").
  void add(const std::string& image, const std::string& user);
  void remove(const std::string& image, const std::string& user);
  // The first user of `image` in name order, nullopt when none.
  std::optional<std::string> first_user(const std::string& image) const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, std::set<std::string>> users_;
};

}  // namespace sg
