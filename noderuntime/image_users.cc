#include "noderuntime/image_users.h"

namespace sg {

Status ImageUsers::add(const std::string& image, const std::string& user) {
  if (image.empty()) return {};
  std::lock_guard lock(mu_);
  if (being_removed_.count(image) != 0)
    return fail(Error::kConflict, "image " + image + " is being removed (sandgate image rm)");
  users_[image].insert(user);
  return {};
}

void ImageUsers::remove(const std::string& image, const std::string& user) {
  std::lock_guard lock(mu_);
  auto it = users_.find(image);
  if (it == users_.end()) return;
  it->second.erase(user);
  if (it->second.empty()) users_.erase(it);
}

std::optional<std::string> ImageUsers::claim_for_removal(const std::string& image) {
  std::lock_guard lock(mu_);
  auto it = users_.find(image);
  if (it != users_.end() && !it->second.empty()) return *it->second.begin();
  being_removed_.insert(image);
  return std::nullopt;
}

void ImageUsers::release_removal(const std::string& image) {
  std::lock_guard lock(mu_);
  being_removed_.erase(image);
}

}  // namespace sg
