// Which sandboxes use which image, so `image rm` of an image a sandbox's root filesystem comes from is
// refused (409 naming the sandbox), and a sandbox cannot start using an image while it is being removed.
// The node's loop adds and removes users as sandboxes come and go; ImageStore::remove claims and releases
// from a libuv pool thread, hence the lock.
//
// The protocol that closes the race between a create and an `image rm`: a remove claims the image (refused
// if it has users; from then on add() refuses it) before it deletes anything and releases it after; a create
// adds itself as a user and only then confirms the image still exists. Either the remove sees the user, or
// the create sees the claim or the image's absence.
#pragma once

#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include "common/error.h"

namespace sg {

class ImageUsers {
 public:
  // `user` is how a refusal names it ("sandbox box (sb-...)"). kConflict while `image` is being removed.
  // An empty image (a sandbox from before images) is no one's and always succeeds.
  [[nodiscard]] Status add(const std::string& image, const std::string& user);
  void remove(const std::string& image, const std::string& user);
  // Why `image` cannot be removed (its first user in name order), or nullopt once it is claimed for removal.
  std::optional<std::string> claim_for_removal(const std::string& image);
  void release_removal(const std::string& image);

 private:
  std::mutex mu_;
  std::map<std::string, std::set<std::string>> users_;
  std::set<std::string> being_removed_;
};

}  // namespace sg
