#include "common/ssh_public_key.h"

#include <libssh/libssh.h>
#include <openssl/evp.h>

#include <algorithm>
#include <cctype>
#include <memory>

namespace sg {
namespace {

struct KeyFree {
  void operator()(ssh_key k) const { ssh_key_free(k); }
};
using KeyPtr = std::unique_ptr<ssh_key_struct, KeyFree>;

bool is_space(char c) { return c == ' ' || c == '\t'; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && (is_space(s.front()) || s.front() == '\r' || s.front() == '\n')) s.remove_prefix(1);
  while (!s.empty() && (is_space(s.back()) || s.back() == '\r' || s.back() == '\n')) s.remove_suffix(1);
  return s;
}

std::string_view next_field(std::string_view& s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  size_t end = 0;
  while (end < s.size() && !is_space(s[end])) ++end;
  std::string_view field = s.substr(0, end);
  s.remove_prefix(end);
  return field;
}

Result<KeyPtr> import(const PublicKey& key) {
  ssh_key raw = nullptr;
  if (ssh_pki_import_pubkey_base64(key.base64.c_str(), ssh_key_type_from_name(key.type.c_str()), &raw) != SSH_OK ||
      raw == nullptr)
    return fail(Error::kInvalidArgument, "the key data is not a valid " + key.type + " public key");
  return KeyPtr(raw);
}

// The modulus size of an ssh-rsa blob (string "ssh-rsa", mpint e, mpint n), which libssh 0.10 does not
// expose; 0 when the blob does not have that shape (libssh already accepted it, so it does).
int rsa_bits(const std::string& base64) {
  std::string blob(base64.size(), '\0');
  int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(blob.data()),
                          reinterpret_cast<const unsigned char*>(base64.data()), static_cast<int>(base64.size()));
  if (n < 0) return 0;
  size_t len = static_cast<size_t>(n) - (base64.ends_with("==") ? 2 : base64.ends_with("=") ? 1 : 0);
  size_t pos = 0;
  auto field = [&](std::string_view* out) {
    if (pos + 4 > len) return false;
    auto b = [&](size_t i) { return static_cast<uint32_t>(static_cast<unsigned char>(blob[pos + i])); };
    uint32_t flen = b(0) << 24 | b(1) << 16 | b(2) << 8 | b(3);
    pos += 4;
    if (flen > len - pos) return false;
    *out = std::string_view(blob).substr(pos, flen);
    pos += flen;
    return true;
  };
  std::string_view type, e, modulus;
  if (!field(&type) || !field(&e) || !field(&modulus)) return 0;
  while (!modulus.empty() && modulus.front() == '\0') modulus.remove_prefix(1);  // mpint's sign byte
  if (modulus.empty()) return 0;
  int bits = static_cast<int>(modulus.size()) * 8;
  for (unsigned char top = static_cast<unsigned char>(modulus.front()); (top & 0x80) == 0; top <<= 1) --bits;
  return bits;
}

}  // namespace

Result<PublicKey> parse_public_key_line(std::string_view line) {
  auto bad = [](std::string why) { return fail(Error::kInvalidArgument, "not an SSH public key: " + why); };
  if (line.size() > kMaxPublicKeyLine)
    return bad("longer than " + std::to_string(kMaxPublicKeyLine) + " bytes");
  line = trim(line);
  if (line.empty()) return bad("empty");
  for (unsigned char c : line)
    if (c < 0x20 && c != '\t') return bad("one line expected (control characters or several lines)");
  PublicKey key;
  key.type = std::string(next_field(line));
  key.base64 = std::string(next_field(line));
  key.comment = std::string(trim(line));
  static constexpr std::string_view kTypes[] = {"ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384",
                                                "ecdsa-sha2-nistp521", "ssh-rsa"};
  if (std::find(std::begin(kTypes), std::end(kTypes), key.type) == std::end(kTypes))
    return bad("type '" + key.type.substr(0, 64) +
               "' is not one of ssh-ed25519, ecdsa-sha2-nistp256/384/521, ssh-rsa (give the .pub file, not options)");
  if (key.base64.empty()) return bad("no key data after the type");
  if (!std::all_of(key.base64.begin(), key.base64.end(), [](unsigned char c) {
        return std::isalnum(c) || c == '+' || c == '/' || c == '=';
      }))
    return bad("the key data is not base64");
  auto imported = import(key);
  if (!imported) return imported.failure();
  // The blob names its own type; a line that says ssh-ed25519 over an RSA blob is refused, not relabelled.
  const char* blob_type = ssh_key_type_to_char(ssh_key_type(imported->get()));
  std::string real = blob_type != nullptr ? blob_type : "";
  if (ssh_key_type(imported->get()) == SSH_KEYTYPE_ECDSA_P256) real = "ecdsa-sha2-nistp256";
  if (ssh_key_type(imported->get()) == SSH_KEYTYPE_ECDSA_P384) real = "ecdsa-sha2-nistp384";
  if (ssh_key_type(imported->get()) == SSH_KEYTYPE_ECDSA_P521) real = "ecdsa-sha2-nistp521";
  if (real != key.type) return bad("the line says " + key.type + " but the key data is " + real);
  if (key.type == "ssh-rsa") {
    int bits = rsa_bits(key.base64);
    if (bits < kMinRsaBits)
      return bad("an RSA key of " + std::to_string(bits) + " bits; at least " + std::to_string(kMinRsaBits) +
                 " are needed");
  }
  return key;
}

std::vector<PublicKey> parse_authorized_keys(std::string_view text) {
  std::vector<PublicKey> out;
  while (!text.empty()) {
    size_t nl = text.find('\n');
    std::string_view line = trim(text.substr(0, nl));
    text.remove_prefix(nl == std::string_view::npos ? text.size() : nl + 1);
    if (line.empty() || line.front() == '#') continue;
    if (auto key = parse_public_key_line(line)) out.push_back(std::move(*key));
  }
  return out;
}

Result<std::string> public_key_fingerprint(const PublicKey& key) {
  auto imported = import(key);
  if (!imported) return imported.failure();
  unsigned char* hash = nullptr;
  size_t len = 0;
  if (ssh_get_publickey_hash(imported->get(), SSH_PUBLICKEY_HASH_SHA256, &hash, &len) != SSH_OK)
    return fail(Error::kInternal, "cannot hash the key");
  char* text = ssh_get_fingerprint_hash(SSH_PUBLICKEY_HASH_SHA256, hash, len);
  ssh_clean_pubkey_hash(&hash);
  if (text == nullptr) return fail(Error::kInternal, "cannot format the fingerprint");
  std::string out(text);
  ssh_string_free_char(text);
  return out;
}

}  // namespace sg
