#include "proxy/ticket_keys.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/rand.h>

#include <algorithm>
#include <cstring>
#include <span>

#include "common/hex.h"

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
  if (serialized.empty() || serialized.size() % per_key != 0 || serialized.size() / per_key > kKept)
    return fail(Error::kInvalidArgument, "session ticket keys: expected 1 to " + std::to_string(kKept) + " keys of " +
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
