#include "proxy/ticket_keys.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/rand.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <span>

#include "common/base64.h"
#include "common/hex.h"
#include "common/secret_file.h"

namespace sg {

namespace {

// Where a context finds its ring (every context of every TlsContexts the ring was installed on).
int ring_ex_index() {
  static const int index = SSL_CTX_get_ex_new_index(0, nullptr, nullptr, nullptr, nullptr);
  return index;
}

}  // namespace

TicketKeys::~TicketKeys() {
  EVP_CIPHER_free(aes_);
  for (Key& k : keys_) OPENSSL_cleanse(&k, sizeof k);
}

Result<TicketKeys::Key> TicketKeys::fresh_key() {
  Key k;
  if (RAND_bytes(k.name.data(), k.name.size()) != 1 || RAND_priv_bytes(k.aes.data(), k.aes.size()) != 1 ||
      RAND_priv_bytes(k.hmac.data(), k.hmac.size()) != 1)
    return fail(Error::kInternal, "no random bytes for a session ticket key");
  return k;
}

Result<std::shared_ptr<TicketKeys>> TicketKeys::generate() {
  std::shared_ptr<TicketKeys> ring(new TicketKeys());
  ring->aes_ = EVP_CIPHER_fetch(nullptr, "AES-256-CBC", nullptr);
  if (ring->aes_ == nullptr) return fail(Error::kInternal, "OpenSSL has no AES-256-CBC for session tickets");
  auto key = fresh_key();
  if (!key) return key.failure();
  ring->keys_.push_back(*key);
  return ring;
}

void TicketKeys::install(SSL_CTX* ctx) {
  SSL_CTX_set_ex_data(ctx, ring_ex_index(), this);
  SSL_CTX_set_tlsext_ticket_key_evp_cb(ctx, &TicketKeys::on_ticket);
}

Status TicketKeys::rotate() {
  if (from_file()) return {};  // the file's owner rotates its keys (only this thread changes from_file_)
  auto key = fresh_key();
  if (!key) return key.failure();
  std::lock_guard lock(mu_);
  keys_.insert(keys_.begin(), *key);
  while (keys_.size() > kKept) {
    OPENSSL_cleanse(&keys_.back(), sizeof(Key));
    keys_.pop_back();
  }
  return {};
}

size_t TicketKeys::size() const {
  std::lock_guard lock(mu_);
  return keys_.size();
}

std::string TicketKeys::serialize() const {
  std::lock_guard lock(mu_);
  std::string out;
  out.reserve(keys_.size() * sizeof(Key) * 2);
  for (const Key& k : keys_) hex_append(std::span(reinterpret_cast<const unsigned char*>(&k), sizeof k), out);
  return out;
}

Status TicketKeys::replace_with(std::string_view serialized) {
  const size_t per_key = sizeof(Key) * 2;
  // Up to kMaxFileKeys: a proxy that read a key file hands over all of them; the next rotation keeps kKept.
  if (serialized.empty() || serialized.size() % per_key != 0 || serialized.size() / per_key > kMaxFileKeys)
    return fail(Error::kInvalidArgument, "session ticket keys: expected 1 to " + std::to_string(kMaxFileKeys) + " keys of " +
                                             std::to_string(per_key) + " hex digits, got " +
                                             std::to_string(serialized.size()) + " characters");
  std::vector<Key> keys(serialized.size() / per_key);
  std::span bytes(reinterpret_cast<unsigned char*>(keys.data()), keys.size() * sizeof(Key));
  if (!hex_decode(serialized, bytes)) {
    OPENSSL_cleanse(bytes.data(), bytes.size());
    return fail(Error::kInvalidArgument, "session ticket keys: not hex");
  }
  std::lock_guard lock(mu_);
  for (Key& k : keys_) OPENSSL_cleanse(&k, sizeof k);
  keys_ = std::move(keys);
  return {};
}

Result<std::vector<TicketKeys::Key>> TicketKeys::read_key_file(const std::string& path) {
  if (path.empty()) return std::vector<Key>();
  auto text = read_secret_file(path, "proxy.tls_ticket_key_file", kMaxKeyFileBytes);
  if (!text) return text.failure();
  auto keys = parse_key_file(*text, path);
  OPENSSL_cleanse(text->data(), text->size());
  return keys;
}

Result<std::vector<TicketKeys::Key>> TicketKeys::parse_key_file(std::string_view text, const std::string& path) {
  std::vector<Key> keys;
  keys.reserve(kMaxFileKeys);  // never reallocated: no copy of a key left unwiped in freed memory
  std::vector<size_t> lines;  // where each key was, for the message about a name used twice
  auto refuse = [&](size_t line, const std::string& why) -> Result<std::vector<Key>> {
    wipe(keys);
    return fail(Error::kInvalidArgument, "proxy.tls_ticket_key_file: " + path +
                                             (line ? " line " + std::to_string(line) : std::string()) + ": " + why);
  };
  size_t line_no = 0;
  while (!text.empty()) {
    ++line_no;
    size_t end = text.find('\n');
    std::string_view line = text.substr(0, end);
    text.remove_prefix(end == std::string_view::npos ? text.size() : end + 1);
    while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back()))) line.remove_suffix(1);
    while (!line.empty() && std::isspace(static_cast<unsigned char>(line.front()))) line.remove_prefix(1);
    if (line.empty() || line.front() == '#') continue;
    if (keys.size() == kMaxFileKeys) return refuse(line_no, "more than " + std::to_string(kMaxFileKeys) + " keys");
    auto bytes = base64_decode(line);
    if (!bytes) return refuse(line_no, "not base64 (each key is the base64 of 80 random bytes: openssl rand 80 | base64 -w0)");
    if (bytes->size() != sizeof(Key)) {
      const size_t got = bytes->size();
      OPENSSL_cleanse(bytes->data(), bytes->size());
      return refuse(line_no, std::to_string(got) + " bytes; a key is " + std::to_string(sizeof(Key)) +
                                 " (16 name, 32 AES, 32 HMAC): openssl rand 80 | base64 -w0");
    }
    Key k;
    std::memcpy(&k, bytes->data(), sizeof k);
    OPENSSL_cleanse(bytes->data(), bytes->size());
    for (size_t i = 0; i < keys.size(); ++i) {
      if (CRYPTO_memcmp(keys[i].name.data(), k.name.data(), k.name.size()) == 0) {
        OPENSSL_cleanse(&k, sizeof k);
        return refuse(line_no, "the same key name as line " + std::to_string(lines[i]) +
                                   " (a ticket names the key that reads it)");
      }
    }
    keys.push_back(k);
    lines.push_back(line_no);
    OPENSSL_cleanse(&k, sizeof k);
  }
  if (keys.empty()) return refuse(0, "no key in it (one per line: openssl rand 80 | base64 -w0)");
  return keys;
}

void TicketKeys::wipe(std::vector<Key>& keys) {
  for (Key& k : keys) OPENSSL_cleanse(&k, sizeof k);
  keys.clear();
}

void TicketKeys::use_file_keys(std::vector<Key> keys) {
  std::lock_guard lock(mu_);
  for (Key& k : keys_) OPENSSL_cleanse(&k, sizeof k);
  keys_ = std::move(keys);
  from_file_ = true;
}

Status TicketKeys::use_own_keys() {
  auto key = fresh_key();
  if (!key) return key.failure();
  std::lock_guard lock(mu_);
  if (!from_file_) return {};
  for (Key& k : keys_) OPENSSL_cleanse(&k, sizeof k);
  keys_.assign(1, *key);
  OPENSSL_cleanse(&*key, sizeof(Key));
  from_file_ = false;
  return {};
}

bool TicketKeys::from_file() const {
  std::lock_guard lock(mu_);
  return from_file_;
}

// OpenSSL's ticket callback (SSL_CTX_set_tlsext_ticket_key_evp_cb). Encrypting: 1 = issue the ticket under
// the newest key. Decrypting: 0 = unknown key (a full handshake), 1 = resume, 2 = resume and issue a new
// ticket, negative = an error.
int TicketKeys::on_ticket(SSL* ssl, unsigned char key_name[16], unsigned char iv[EVP_MAX_IV_LENGTH],
                          EVP_CIPHER_CTX* cipher, EVP_MAC_CTX* mac, int encrypt) {
  auto* ring = static_cast<TicketKeys*>(SSL_CTX_get_ex_data(SSL_get_SSL_CTX(ssl), ring_ex_index()));
  if (ring == nullptr) return -1;
  std::lock_guard lock(ring->mu_);
  const Key* key = nullptr;
  int found = 1;
  if (encrypt) {
    if (ring->keys_.empty()) return 0;
    key = &ring->keys_.front();
    if (RAND_bytes(iv, EVP_CIPHER_get_iv_length(ring->aes_)) != 1) return -1;
    std::memcpy(key_name, key->name.data(), key->name.size());
  } else {
    auto it = std::find_if(ring->keys_.begin(), ring->keys_.end(),
                           [&](const Key& k) { return CRYPTO_memcmp(k.name.data(), key_name, k.name.size()) == 0; });
    if (it == ring->keys_.end()) return 0;
    key = &*it;
    // TLS 1.3 resumptions always bring a fresh ticket (OpenSSL's own behaviour; RFC 8446 C.4 advises a client
    // to use each ticket once), TLS 1.2 ones only when the key is no longer the newest.
    found = it == ring->keys_.begin() && SSL_version(ssl) < TLS1_3_VERSION ? 1 : 2;
  }
  OSSL_PARAM params[] = {
      OSSL_PARAM_construct_octet_string(OSSL_MAC_PARAM_KEY, const_cast<unsigned char*>(key->hmac.data()),
                                        key->hmac.size()),
      OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, const_cast<char*>("SHA256"), 0),
      OSSL_PARAM_construct_end()};
  if (EVP_MAC_CTX_set_params(mac, params) != 1) return -1;
  const int ok = encrypt ? EVP_EncryptInit_ex(cipher, ring->aes_, nullptr, key->aes.data(), iv)
                         : EVP_DecryptInit_ex(cipher, ring->aes_, nullptr, key->aes.data(), iv);
  return ok == 1 ? found : -1;
}

}  // namespace sg
