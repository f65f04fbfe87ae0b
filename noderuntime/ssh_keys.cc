#include "noderuntime/ssh_keys.h"

#include <fcntl.h>
#include <libssh/libssh.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <memory>

#include "common/fd.h"

namespace sg {
namespace {

constexpr size_t kMaxStoreBytes = kMaxSshKeys * (kMaxPublicKeyLine + kMaxSshKeyLabel + 2);
constexpr const char* kAuthorizedKeys = "authorized_keys";
constexpr const char* kHostKey = "host_ed25519";

Result<std::string> read_file(const std::string& path, size_t max) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (!fd.valid()) return errno == ENOENT ? fail(Error::kNotFound, path) : fail_errno("open " + path, errno);
  std::string text;
  char buf[8192];
  ssize_t n;
  while ((n = ::read(fd.get(), buf, sizeof buf)) > 0) {
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > max) return fail(Error::kLimitExceeded, path + " is larger than " + std::to_string(max) + " bytes");
  }
  if (n < 0) return fail_errno("read " + path, errno);
  return text;
}

Status make_dir(const std::string& dir, mode_t mode) {
  if (::mkdir(dir.c_str(), mode) != 0 && errno != EEXIST) return fail_errno("mkdir " + dir, errno);
  if (::chmod(dir.c_str(), mode) != 0) return fail_errno("chmod " + dir, errno);
  return {};
}

struct KeyFree {
  void operator()(ssh_key k) const { ssh_key_free(k); }
};

}  // namespace

Status validate_ssh_key_label(std::string_view label) {
  auto bad = [&](std::string_view why) {
    return fail(Error::kInvalidArgument, "invalid key label '" + std::string(label.substr(0, kMaxSshKeyLabel)) +
                                             "': " + std::string(why));
  };
  if (label.empty() || label.size() > kMaxSshKeyLabel) return bad("must be 1-64 characters");
  if (!std::isalnum(static_cast<unsigned char>(label.front()))) return bad("must start with a letter or digit");
  for (unsigned char c : label)
    if (!std::isalnum(c) && c != '.' && c != '_' && c != '-' && c != '@')
      return bad("only letters, digits, '.', '_', '-' and '@'");
  return {};
}

Result<SshKeyStore> SshKeyStore::open(std::string dir) {
  if (Status s = make_dir(dir, 0755); !s) return s.failure();
  SshKeyStore store(std::move(dir));
  auto text = read_file(store.dir_ + "/" + kAuthorizedKeys, kMaxStoreBytes);
  if (!text) {
    if (text.error() == Error::kNotFound) return store;  // no key registered yet
    return text.failure();
  }
  std::string_view rest = *text;
  while (!rest.empty()) {
    size_t nl = rest.find('\n');
    std::string_view line = rest.substr(0, nl);
    rest.remove_prefix(nl == std::string_view::npos ? rest.size() : nl + 1);
    if (line.empty() || line.front() == '#') continue;
    auto key = parse_public_key_line(line);
    if (!key || !validate_ssh_key_label(key->comment) || store.keys_.size() == kMaxSshKeys) {
      spdlog::warn("ssh keys: dropping a line of {}/{}: {}", store.dir_, kAuthorizedKeys,
                   key ? "its label is not valid or the store is full" : key.message());
      continue;
    }
    auto fingerprint = public_key_fingerprint(*key);
    store.keys_.push_back(SshKeyEntry{key->comment, *key, fingerprint ? *fingerprint : ""});
  }
  return store;
}

Result<SshKeyEntry> SshKeyStore::add(std::string_view label, std::string_view line) {
  auto key = parse_public_key_line(line);
  if (!key) return key.failure();
  auto fingerprint = public_key_fingerprint(*key);
  if (!fingerprint) return fingerprint.failure();
  std::string chosen(label);
  if (chosen.empty()) {
    chosen = validate_ssh_key_label(key->comment) ? key->comment : "key-" + fingerprint->substr(7, 12);
    // A hash may carry '+' or '/', which labels do not.
    std::replace_if(chosen.begin(), chosen.end(), [](char c) { return c == '+' || c == '/'; }, '-');
  }
  if (Status s = validate_ssh_key_label(chosen); !s) return s.failure();
  for (const SshKeyEntry& e : keys_) {
    if (e.label == chosen) return fail(Error::kAlreadyExists, "a key labelled '" + chosen + "' is registered already");
    if (e.key.canonical() == key->canonical())
      return fail(Error::kAlreadyExists, "this key is registered already, as '" + e.label + "'");
  }
  if (keys_.size() >= kMaxSshKeys)
    return fail(Error::kLimitExceeded, "the node holds " + std::to_string(kMaxSshKeys) + " keys, the limit");
  key->comment = chosen;
  keys_.push_back(SshKeyEntry{chosen, *key, *fingerprint});
  if (Status s = write(); !s) {
    keys_.pop_back();
    return s.failure();
  }
  return keys_.back();
}

Status SshKeyStore::remove(std::string_view label) {
  auto it = std::find_if(keys_.begin(), keys_.end(), [&](const SshKeyEntry& e) { return e.label == label; });
  if (it == keys_.end()) return fail(Error::kNotFound, "no key labelled '" + std::string(label) + "'");
  SshKeyEntry removed = *it;
  size_t at = static_cast<size_t>(it - keys_.begin());
  keys_.erase(it);
  if (Status s = write(); !s) {
    keys_.insert(keys_.begin() + static_cast<long>(at), std::move(removed));
    return s;
  }
  return {};
}

// A temporary file in the same directory, fsynced, then renamed over the old one: every reader (the agents
// through their binds) sees the old list or the new one, never a torn one.
Status SshKeyStore::write() const {
  std::string text = "# sandgate: keys registered with `sandgate ssh-keys add`; written by the node\n";
  for (const SshKeyEntry& e : keys_) text += e.key.canonical() + " " + e.label + "\n";
  std::string path = dir_ + "/" + kAuthorizedKeys;
  std::string tmp = path + ".tmp";
  ::unlink(tmp.c_str());
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644));
  if (!fd.valid()) return fail_errno("create " + tmp, errno);
  bool ok = ::fchmod(fd.get(), 0644) == 0 &&
            ::write(fd.get(), text.data(), text.size()) == static_cast<ssize_t>(text.size()) && ::fsync(fd.get()) == 0;
  int err = errno;
  fd.reset();
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    if (ok) err = errno;
    ::unlink(tmp.c_str());
    return fail_errno("write " + path, err);
  }
  return {};
}

Result<std::string> host_public_key(const std::string& dir) {
  std::string path = dir + "/" + kHostKey;
  ssh_key raw = nullptr;
  if (ssh_pki_import_privkey_file(path.c_str(), nullptr, nullptr, nullptr, &raw) != SSH_OK || raw == nullptr)
    return fail(Error::kIo, "cannot read the host key " + path);
  std::unique_ptr<ssh_key_struct, KeyFree> key(raw);
  char* b64 = nullptr;
  if (ssh_pki_export_pubkey_base64(key.get(), &b64) != SSH_OK || b64 == nullptr)
    return fail(Error::kInternal, "cannot export the public half of " + path);
  std::string line = std::string(ssh_key_type_to_char(ssh_key_type(key.get()))) + " " + b64;
  ssh_string_free_char(b64);
  return line;
}

Result<std::string> ensure_host_key(const std::string& dir, uid_t owner) {
  if (Status s = make_dir(dir, 0700); !s) return s.failure();
  if (::chown(dir.c_str(), owner, owner) != 0) return fail_errno("chown " + dir, errno);
  std::string path = dir + "/" + kHostKey;
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0) return host_public_key(dir);
  ssh_key raw = nullptr;
  if (ssh_pki_generate(SSH_KEYTYPE_ED25519, 0, &raw) != SSH_OK || raw == nullptr)
    return fail(Error::kInternal, "cannot generate an ed25519 host key");
  std::unique_ptr<ssh_key_struct, KeyFree> key(raw);
  std::string tmp = path + ".tmp";
  ::unlink(tmp.c_str());
  if (ssh_pki_export_privkey_file(key.get(), nullptr, nullptr, nullptr, tmp.c_str()) != SSH_OK)
    return fail(Error::kIo, "cannot write the host key " + tmp);
  if (::chmod(tmp.c_str(), 0600) != 0 || ::chown(tmp.c_str(), owner, owner) != 0 ||
      ::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return fail_errno("install the host key " + path, err);
  }
  return host_public_key(dir);
}

std::string host_key_path(const std::string& dir) { return dir + "/" + kHostKey; }

Result<GuestSshFiles> read_guest_ssh_files(const std::string& keys_dir, const std::string& host_dir) {
  GuestSshFiles files;
  // A private key file of ssh_pki_export_privkey_file is well under 4 KiB.
  auto host_key = read_file(host_key_path(host_dir), 16 * 1024);
  if (!host_key) return host_key.failure();
  files.host_key = std::move(*host_key);
  auto keys = read_file(keys_dir + "/" + kAuthorizedKeys, kMaxStoreBytes);
  if (keys) files.authorized_keys = std::move(*keys);
  else if (keys.error() != Error::kNotFound) return keys.failure();
  return files;
}

}  // namespace sg
