#include "noderuntime/image_users.h"

namespace sg {

void ImageUsers::add(const std::string& image, const std::string& user) {
  if (image.empty()) return;
  std::lock_guard lock(mu_);
  users_[image].insert(user);
}

void ImageUsers::remove(const std::string& image, const std::string& user) {
  std::lock_guard lock(mu_);
  auto it = users_.find(image);
  if (it == users_.end()) return;
  it->second.erase(user);
  if (it->second.empty()) users_.erase(it);
}

std::optional<std::string> ImageUsers::first_user(const std::string& image) const {
  std::lock_guard lock(mu_);
  auto it = users_.find(image);
  if (it == users_.end() || it->second.empty()) return std::nullopt;
  return *it->second.begin();
}

}  // namespace sg
