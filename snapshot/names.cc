#include "snapshot/names.h"

#include <vector>

namespace sg::snapshot {

Status check_image_name(std::string_view name) {
  auto ok = [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'); };
  bool valid = !name.empty() && name.size() <= kMaxNameLength && ok(name[0]);
  for (char c : name) valid = valid && (ok(c) || c == '.' || c == '_' || c == ':' || c == '-');
  if (!valid)
    return fail(Error::kInvalidArgument, "invalid image name '" + std::string(name) + "': 1 to " +
                                             std::to_string(kMaxNameLength) +
                                             " of A-Z a-z 0-9 . _ : -, starting with a letter or digit");
  return {};
}

std::optional<std::string> normalize_relative(std::string_view path, bool resolve_dotdot) {
  if (path.starts_with('/')) return std::nullopt;
  std::vector<std::string_view> parts;
  size_t i = 0;
  while (i <= path.size()) {
    size_t j = path.find('/', i);
    if (j == std::string_view::npos) j = path.size();
    std::string_view part = path.substr(i, j - i);
    i = j + 1;
    if (part.empty() || part == ".") continue;
    if (part == "..") {
      if (!resolve_dotdot || parts.empty()) return std::nullopt;
      parts.pop_back();
      continue;
    }
    parts.push_back(part);
  }
  std::string out;
  for (std::string_view p : parts) {
    if (!out.empty()) out += '/';
    out += p;
  }
  return out;
}

}  // namespace sg::snapshot
