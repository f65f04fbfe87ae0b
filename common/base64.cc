#include "common/base64.h"

#include <openssl/evp.h>

#include <cctype>

namespace sg {

std::string base64_encode(std::string_view bytes) {
  std::string out(4 * ((bytes.size() + 2) / 3) + 1, '\0');  // EVP_EncodeBlock writes a NUL after
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(bytes.data()), static_cast<int>(bytes.size()));
  out.resize(n > 0 ? static_cast<size_t>(n) : 0);
  return out;
}

Result<std::string> base64_decode(std::string_view text) {
  if (text.size() % 4 != 0) return fail(Error::kInvalidArgument, "base64 of a length that is not a multiple of 4");
  // EVP_DecodeBlock skips leading and trailing whitespace, which is not base64 here.
  for (char c : text)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '+' || c == '/' || c == '='))
      return fail(Error::kInvalidArgument, "not base64");
  std::string out(text.size() / 4 * 3, '\0');
  const int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(text.data()), static_cast<int>(text.size()));
  if (n < 0) return fail(Error::kInvalidArgument, "not base64");
  // EVP_DecodeBlock counts the padding's bytes as data.
  size_t len = static_cast<size_t>(n);
  if (text.ends_with("==")) len -= 2;
  else if (text.ends_with("=")) len -= 1;
  out.resize(len);
  return out;
}

}  // namespace sg
