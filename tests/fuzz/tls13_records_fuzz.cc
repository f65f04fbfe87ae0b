// TLS 1.3 records as the proxy's own record layer reads them from a client once OpenSSL has let go
// (proxy/tls13_record_layer.h). The input is a list of things to put on the wire: raw bytes (headers, lengths
// and types of the input's choosing), or a record sealed under the key the reader expects, with the input's
// content type, content and padding, so that authentication passes and what lies behind it is reached
// (alerts, KeyUpdate and the key change it makes, padding, empty records, lengths at the limits). The reader's
// room comes from the input too, so records are also handed out in parts. What it hands out must be the
// application data that was sealed, in order.
#include <openssl/evp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "proxy/ktls.h"
#include "proxy/tls13_record_layer.h"

namespace {

// The client's side: AES-128-GCM under a secret both sides know, its key moved on by its own KeyUpdates.
class Sealer {
 public:
  Sealer() { std::memset(secret_, 0x5a, sizeof secret_); derive(); }
  void update() {
    unsigned char next[32];
    (void)sg::tls13_hkdf_expand_label(EVP_sha256(), secret_, "traffic upd", next, sizeof next);
    std::memcpy(secret_, next, sizeof secret_);
    derive();
  }
  std::string seal(uint8_t type, const unsigned char* content, size_t size, size_t padding) {
    std::string inner(reinterpret_cast<const char*>(content), size);
    inner.push_back(static_cast<char>(type));
    inner.append(padding, '\0');
    const size_t len = inner.size() + 16;
    std::string out = {'\x17', '\x03', '\x03', static_cast<char>(len >> 8), static_cast<char>(len)};
    out.resize(5 + len);
    unsigned char nonce[12];
    std::memcpy(nonce, iv_, 12);
    for (int i = 0; i < 8; ++i) nonce[11 - i] ^= static_cast<unsigned char>(seq_ >> (8 * i));
    ++seq_;
    EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
    int n = 0;
    auto* o = reinterpret_cast<unsigned char*>(out.data());
    EVP_EncryptInit_ex(ctx, EVP_aes_128_gcm(), nullptr, key_, nonce);
    EVP_EncryptUpdate(ctx, nullptr, &n, o, 5);
    EVP_EncryptUpdate(ctx, o + 5, &n, reinterpret_cast<const unsigned char*>(inner.data()), static_cast<int>(inner.size()));
    EVP_EncryptFinal_ex(ctx, o + 5 + inner.size(), &n);
    EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_AEAD_GET_TAG, 16, o + 5 + inner.size());
    EVP_CIPHER_CTX_free(ctx);
    return out;
  }
  const unsigned char* secret() const { return secret_; }

 private:
  void derive() {
    (void)sg::tls13_hkdf_expand_label(EVP_sha256(), secret_, "key", key_, sizeof key_);
    (void)sg::tls13_hkdf_expand_label(EVP_sha256(), secret_, "iv", iv_, sizeof iv_);
    seq_ = 0;
  }
  unsigned char secret_[32];
  unsigned char key_[16];
  unsigned char iv_[12];
  uint64_t seq_ = 0;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  Sealer client;
  unsigned char server_secret[32];
  std::memset(server_secret, 0xa5, sizeof server_secret);
  auto layer = sg::Tls13RecordLayer::create({0x1301, EVP_sha256(), std::span(client.secret(), 32), 0,
                                             std::span<const unsigned char>(server_secret), 0});
  if (!layer) __builtin_trap();
  const size_t room = 1 + data[0] % 128 * 200;  // 1 .. 25,401 bytes
  std::string wire;
  // What the reader must hand out: the application data sealed, in order. It stops at the first record it
  // refuses (raw bytes never authenticate), so what it hands out is a prefix of this.
  std::string sealed_data;
  size_t at = 1;
  while (at < size && wire.size() < 150000) {
    const uint8_t op = data[at++];
    size_t len = at + 2 <= size ? (size_t{data[at]} << 8 | data[at + 1]) : 0;
    at = std::min(size, at + 2);
    len = std::min(len, size - at);
    if (op & 1) {
      wire.append(reinterpret_cast<const char*>(data + at), len);  // raw
    } else {
      const uint8_t type = op >> 1 & 3 ? static_cast<uint8_t>(20 + (op >> 1 & 3)) : static_cast<uint8_t>(op >> 3);
      const size_t padding = op >> 3 & 7 ? (op >> 3) * 9 : 0;
      wire += client.seal(type, data + at, len, padding);
      // The type is the inner plaintext's last byte that is not zero (a type 0 lets content bytes be it).
      std::string inner(reinterpret_cast<const char*>(data + at), len);
      inner.push_back(static_cast<char>(type));
      while (!inner.empty() && inner.back() == '\0') inner.pop_back();
      if (!inner.empty() && inner.back() == 23) sealed_data.append(inner, 0, inner.size() - 1);
      // The reader moves its key on after a KeyUpdate; so must the writer, for what follows to authenticate.
      if (type == 22 && len == 5 && data[at] == 24 && data[at + 1] == 0 && data[at + 2] == 0 && data[at + 3] == 1 &&
          data[at + 4] <= 1)
        client.update();
    }
    at += len;
  }
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, sv) != 0) return 0;
  int sndbuf = 1 << 20;
  ::setsockopt(sv[1], SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
  size_t sent = 0;
  std::vector<char> buf(room);
  std::string got;
  for (int rounds = 0; rounds < 10000; ++rounds) {
    if (sent < wire.size()) {
      ssize_t n = ::send(sv[1], wire.data() + sent, wire.size() - sent, MSG_NOSIGNAL);
      if (n > 0) sent += static_cast<size_t>(n);
      if (sent == wire.size()) ::shutdown(sv[1], SHUT_WR);
    }
    sg::IoResult r = (*layer)->read(sv[0], buf);
    if (r.bytes > buf.size()) __builtin_trap();
    got.append(buf.data(), r.bytes);
    if (got.size() > sealed_data.size() || sealed_data.compare(0, got.size(), got) != 0) __builtin_trap();
    (void)(*layer)->has_buffered_input();
    if (r.status == sg::IoResult::Status::kError || r.status == sg::IoResult::Status::kEof) break;
  }
  // What the reader owes (a KeyUpdate the client asked for) goes out with the next write.
  (void)(*layer)->write(sv[0], std::string_view("answer"));
  ::close(sv[0]);
  ::close(sv[1]);
  return 0;
}
