// The keys that encrypt the TLS session tickets the proxy hands out, kept by the process rather than by each
// SSL_CTX. OpenSSL's own keys are random per SSL_CTX, so every SIGHUP (which builds new contexts) and every
// binary upgrade would make every ticket out there useless: each client's next connection a full handshake.
// Here one ring serves every context of the process and of each reload, and a takeover hands it to the new
// process with the listeners (proxy/listener_handover.h).
//
// Forward secrecy: the ring rotates (proxy.tls_ticket_key_rotation_secs). New tickets use the newest key;
// a ticket under one of the kKept - 1 keys before it still resumes, and the client gets a ticket under the
// newest key. A key is gone for good kKept rotations after it was made, so a ticket outlives its key by at
// most that. A ticket under a key the ring does not have means a full handshake, never a failure.
//
// Shared keys (proxy.tls_ticket_key_file): the proxies of a fleet, or behind one load balancer, read the same
// key file, so a ticket one of them issued resumes at another. The file's owner rotates them (the ring then
// never rotates on its own): one key per line, the first issues tickets and every one reads them.
//
// Thread-safe: the workers' handshakes read the ring while the main thread rotates or replaces it.
#pragma once

#include <openssl/evp.h>
#include <openssl/ssl.h>

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "common/error.h"

namespace sg {

class TicketKeys {
 public:
  static constexpr size_t kKept = 3;  // the newest, which encrypts, and two older ones, which still decrypt

  struct Key {
    std::array<unsigned char, 16> name{};  // sent in the clear in each ticket: which key to decrypt with
    std::array<unsigned char, 32> aes{};   // AES-256-CBC, as OpenSSL's own tickets
    std::array<unsigned char, 32> hmac{};  // HMAC-SHA256 over the encrypted ticket
  };
  // The three fields are the key's 80 bytes, in order (serialize() and replace_with() read and write them so).
  static_assert(sizeof(Key) == 16 + 32 + 32 && std::is_trivially_copyable_v<Key>);

  // A ring with one fresh random key.
  static Result<std::shared_ptr<TicketKeys>> generate();
  ~TicketKeys();
  TicketKeys(const TicketKeys&) = delete;
  TicketKeys& operator=(const TicketKeys&) = delete;

  // Every handshake on `ctx` issues and reads tickets with this ring. The context keeps a reference (ex data
  // plus the caller's shared_ptr): the ring must outlive it.
  void install(SSL_CTX* ctx);

  // A fresh key becomes the newest; the oldest beyond kKept is dropped.
  Status rotate();

  // For the handover: every key, newest first, as hex (secret: the handover socket is 0600, same user).
  std::string serialize() const;
  // Replaces the ring with a serialized one (the previous process's). A malformed text changes nothing.
  Status replace_with(std::string_view serialized);

  size_t size() const;

  // proxy.tls_ticket_key_file: one key per line, the base64 of its 80 bytes in the order of Key (what
  // `openssl rand 80 | base64 -w0` makes); blank lines and lines starting with '#' are skipped. The first key
  // issues tickets. Read like every secret file (owner-only, common/secret_file.h). Errors name the line:
  // not base64, not 80 bytes, a key name used twice, more than kMaxFileKeys keys, none. An empty path (no
  // file configured) reads no keys.
  static constexpr size_t kMaxFileKeys = 16;
  static constexpr size_t kMaxKeyFileBytes = 16 * 1024;
  static Result<std::vector<Key>> read_key_file(const std::string& path);
  static Result<std::vector<Key>> parse_key_file(std::string_view text, const std::string& path);
  // Overwrites the keys' bytes (a copy that is not to stay in memory) and empties the vector.
  static void wipe(std::vector<Key>& keys);
  // The ring becomes the file's keys, and stays so: rotate() leaves it until use_own_keys().
  void use_file_keys(std::vector<Key> keys);
  // Back to keys of the process's own (a reload dropped the key file): one fresh key, rotated again.
  Status use_own_keys();
  bool from_file() const;

 private:
  TicketKeys() = default;
  static int on_ticket(SSL* ssl, unsigned char key_name[16], unsigned char iv[EVP_MAX_IV_LENGTH],
                       EVP_CIPHER_CTX* cipher, EVP_MAC_CTX* mac, int encrypt);
  static Result<Key> fresh_key();

  mutable std::mutex mu_;
  std::vector<Key> keys_;  // newest first
  bool from_file_ = false;
  EVP_CIPHER* aes_ = nullptr;  // fetched once, not per ticket
};

}  // namespace sg
