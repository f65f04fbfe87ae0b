// SSH access to sandboxes (docs/ssh.md): the public keys registered with the node (`sandgate ssh-keys`) and
// each sandbox's host key.
//
// The registered keys live in ONE file, <dir>/authorized_keys, in OpenSSH's authorized_keys format with the
// label as each line's comment. That file is both the store and what every sandbox's agent reads: the
// process driver binds <dir> read-only into each sandbox, and a change is a rename within <dir>, which the
// bind shows at once, so a key added or removed counts from the next connection on, in every sandbox.
// Public keys are not secrets: the file is 0644.
#pragma once

#include <sys/types.h>

#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/ssh_public_key.h"

namespace sg {

inline constexpr size_t kMaxSshKeys = 100;
// Where a node keeps the registered keys: <state_dir>/ssh-keys.
inline std::string ssh_keys_dir(const std::string& state_dir) { return state_dir + "/ssh-keys"; }
inline constexpr size_t kMaxSshKeyLabel = 64;

struct SshKeyEntry {
  std::string label;
  PublicKey key;
  std::string fingerprint;  // SHA256:...
};

// 1-64 of letters, digits, '.', '_', '-', '@', starting with a letter or digit.
Status validate_ssh_key_label(std::string_view label);

class SshKeyStore {
 public:
  // Creates `dir` (0755) if needed; an existing authorized_keys is read (lines that do not parse are dropped
  // at the next write, with a warning in the log).
  static Result<SshKeyStore> open(std::string dir);

  const std::string& dir() const { return dir_; }
  const std::vector<SshKeyEntry>& list() const { return keys_; }
  // `line` is the content of a .pub file. `label` empty: the key's comment if it is a valid label, else
  // "key-" and the first 12 characters of the fingerprint's hash. kAlreadyExists for a label or a key
  // already registered, kLimitExceeded beyond kMaxSshKeys, kInvalidArgument for a bad key or label.
  Result<SshKeyEntry> add(std::string_view label, std::string_view line);
  // kNotFound when no key has this label.
  Status remove(std::string_view label);

 private:
  explicit SshKeyStore(std::string dir) : dir_(std::move(dir)) {}
  Status write() const;

  std::string dir_;
  std::vector<SshKeyEntry> keys_;
};

// <dir>/host_ed25519: created (an ed25519 key, OpenSSH format, mode 0600, owned by `owner`, <dir> 0700 owned
// by `owner`) when missing, kept as it is otherwise, so a sandbox keeps its host key across restarts of the
// node and of the sandbox. Returns the public key line ("ssh-ed25519 BASE64").
Result<std::string> ensure_host_key(const std::string& dir, uid_t owner);
// The private key file ensure_host_key makes in `dir`.
std::string host_key_path(const std::string& dir);

// What a VM's guest is sent (it cannot see the node's files through bind mounts as a process sandbox does):
// the sandbox's host key from `host_dir` and the node's registered keys from `keys_dir` as they are now
// (empty when none is registered yet).
struct GuestSshFiles {
  std::string host_key;
  std::string authorized_keys;
};
Result<GuestSshFiles> read_guest_ssh_files(const std::string& keys_dir, const std::string& host_dir);
// The public key line of an existing <dir>/host_ed25519.
Result<std::string> host_public_key(const std::string& dir);

}  // namespace sg
