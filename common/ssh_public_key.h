// One OpenSSH public key line ("TYPE BASE64 [COMMENT]", as in id_ed25519.pub and authorized_keys),
// validated with libssh: the node checks what `sandgate ssh-keys add` sends, the agent reads the node's
// authorized_keys file with the same parser, so both agree on what a key is.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"

namespace sg {

inline constexpr size_t kMaxPublicKeyLine = 16 * 1024;  // an RSA-16384 key is ~2.8 KB; anything longer is not a key
inline constexpr int kMinRsaBits = 2048;                 // OpenSSH 8.x refuses smaller RSA keys too

struct PublicKey {
  std::string type;     // "ssh-ed25519", "ecdsa-sha2-nistp256", ... (the blob's own type, checked)
  std::string base64;   // the key blob, as given
  std::string comment;  // the rest of the line, may be empty
  // "TYPE BASE64" (no comment): two keys are the same key exactly when these are equal.
  std::string canonical() const { return type + " " + base64; }
};

// kInvalidArgument (with why) for anything but one key of an accepted type: ssh-ed25519, ecdsa-sha2-nistp256/
// 384/521, ssh-rsa of at least kMinRsaBits bits (sk-* hardware keys and DSA are refused). Options before the
// type (authorized_keys' `command=...`) are not accepted.
Result<PublicKey> parse_public_key_line(std::string_view line);

// Every valid key line of an authorized_keys text; blank lines and '#' comments are skipped, and so is a line
// that does not parse (one bad line must not lock everybody out).
std::vector<PublicKey> parse_authorized_keys(std::string_view text);

// The SHA256:... fingerprint OpenSSH prints (ssh-keygen -lf), of a key parse_public_key_line accepted.
Result<std::string> public_key_fingerprint(const PublicKey& key);

}  // namespace sg
