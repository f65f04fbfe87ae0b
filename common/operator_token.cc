#include "common/operator_token.h"

#include "common/secret_file.h"

namespace sg {
namespace {

std::string trim(std::string s) {
  const char* ws = " \t\r\n\v\f";
  size_t end = s.find_last_not_of(ws);
  if (end == std::string::npos) return {};
  size_t begin = s.find_first_not_of(ws);
  return s.substr(begin, end + 1 - begin);
}

}  // namespace

Result<std::string> read_operator_token(const std::string& path) {
  if (path.empty()) return std::string();
  // The token opens every sandbox and (over node.api_listen) the whole API.
  auto text = read_secret_file(path, "operator_token_file", kMaxOperatorTokenBytes);
  if (!text) return text.failure();
  std::string token = trim(std::move(*text));
  if (token.empty()) return fail(Error::kInvalidArgument, "operator_token_file: " + path + " holds no token");
  return token;
}

}  // namespace sg
