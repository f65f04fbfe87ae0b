// One accepted TCP connection: owns the socket and its libuv handles, sniffs the first bytes for the h2c
// prior-knowledge preface, and hands the byte stream to the protocol it found (HTTP/1.1 or HTTP/2).
#pragma once

#include <uv.h>

#include <memory>
#include <string>
#include <string_view>

#include "agent/routes.h"

namespace sg::agent {

class AgentServer;

// A protocol drives the exchanges on a connection. Every call comes from the connection's own event
// handling, never from inside a handler: handlers only queue output and call Connection::schedule().
class Protocol {
 public:
  virtual ~Protocol() = default;
  virtual void on_input(std::string_view data) = 0;
  virtual void on_eof() = 0;
  virtual void on_written() = 0;  // a write completed: the send queue shrank
  virtual void on_soon() = 0;     // the deferred work schedule() asked for
  virtual void on_close() = 0;    // the connection is closing: drop (and so cancel) every handler
};

class Connection {
 public:
  explicit Connection(AgentServer& server);
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Takes the pending connection from the listener and starts reading. On failure it is closing already.
  Status accept(uv_stream_t* listener);

  Router& router();
  const AgentLimits& limits() const;
  void write(std::string bytes);
  size_t write_queue_bytes() const;
  // Protocol::on_soon() on the next loop iteration.
  void schedule();
  void set_reading(bool on);
  // Sends FIN after what is queued, then discards input until the peer closes (closing with unread input
  // would reset the connection and could destroy the last answer in flight), for at most a linger time.
  void end_after_writes();
  // Closes at once; the object frees itself when its handles have closed.
  void close_now();
  bool closing() const { return closing_; }

 private:
  ~Connection() = default;
  uv_stream_t* stream() { return reinterpret_cast<uv_stream_t*>(&tcp_); }
  const uv_stream_t* stream() const { return reinterpret_cast<const uv_stream_t*>(&tcp_); }
  void on_read(ssize_t nread, const uv_buf_t* buf);
  void choose_protocol();
  void on_handle_closed();

  AgentServer& server_;
  uv_tcp_t tcp_{};
  uv_idle_t soon_{};
  uv_timer_t linger_{};
  int open_handles_ = 0;
  std::unique_ptr<Protocol> protocol_;
  std::string sniffed_;  // the first bytes, until they tell the protocol
  std::unique_ptr<char[]> read_buf_;
  bool reading_ = false;
  bool peer_eof_ = false;
  bool ending_ = false;    // end_after_writes() was called: input no longer reaches the protocol
  bool draining_ = false;  // FIN sent: waiting for the peer's
  bool closing_ = false;
};

std::unique_ptr<Protocol> make_http1(Connection& conn);
std::unique_ptr<Protocol> make_http2(Connection& conn);

}  // namespace sg::agent
