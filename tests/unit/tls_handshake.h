// Both ends of a TLS connection in one thread (a nonblocking socketpair): the client's and the proxy's
// handshake steps in turn until both are done. The proxy's ClientHello callback asks for the port's policy
// (SSL_ERROR_WANT_CLIENT_HELLO_CB); it is answered as the node answers an ordinary HTTP port. Shared by the
// unit tests and bench/tls_memory.cc.
#pragma once

#include <openssl/ssl.h>

#include "proxy/tls.h"

namespace sg::test_support {

// `server_call` runs each of the server's steps (a benchmark counts what they allocate); false when either
// end failed or the handshake did not finish.
template <class ServerCall>
bool handshake_in_turn(SSL* client, SSL* server, HelloState& hello, ServerCall&& server_call) {
  bool client_done = false, server_done = false;
  for (int round = 0; round < 100 && !(client_done && server_done); ++round) {
    if (!client_done) {
      const int r = SSL_do_handshake(client);
      if (r == 1) client_done = true;
      else if (SSL_get_error(client, r) != SSL_ERROR_WANT_READ) return false;
    }
    if (!server_done) {
      const int r = server_call([&] { return SSL_do_handshake(server); });
      if (r == 1) {
        server_done = true;
      } else if (const int err = SSL_get_error(server, r); err == SSL_ERROR_WANT_CLIENT_HELLO_CB) {
        hello.policy_known = true;
        hello.port_protocol = "http1";
      } else if (err != SSL_ERROR_WANT_READ) {
        return false;
      }
    }
  }
  return client_done && server_done;
}

inline bool handshake_in_turn(SSL* client, SSL* server, HelloState& hello) {
  return handshake_in_turn(client, server, hello, [](auto step) { return step(); });
}

}  // namespace sg::test_support
