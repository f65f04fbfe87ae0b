// One direction of a forwarded connection (client -> sandbox or sandbox -> client), written once for
// both: bytes move from a source transport to a sink transport through a buffer (copied) or, when both
// ends can splice, through a pipe (the kernel moves them, and with kTLS does the record crypto). An
// optional stage sits between the two on a copied direction: the request filter on client -> sandbox,
// the h2 frame pass (the proxy's own frames inserted) on sandbox -> client.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "proxy/splice_pipe.h"
#include "proxy/transport.h"

namespace sg {

// A fixed-size byte buffer filled at the end and drained from the front; never reallocated. The memory is
// taken at the first write and may be given back whenever the buffer is empty (release), so a direction
// that only ever splices, or waits for its source, holds none.
class ByteBuffer {
 public:
  explicit ByteBuffer(size_t capacity) : cap_(capacity) {}
  char* read_ptr() { return data_.get() + start_; }
  size_t readable() const { return end_ - start_; }
  char* write_ptr() {
    if (!data_) data_.reset(new char[cap_]);
    return data_.get() + end_;
  }
  size_t space() const { return cap_ - end_; }
  void produced(size_t n) { end_ += n; }
  void consumed(size_t n) {
    start_ += n;
    if (start_ == end_) start_ = end_ = 0;
  }
  bool holds_memory() const { return data_ != nullptr; }
  // Gives the memory back to the allocator, only when nothing is unread.
  void release() {
    if (readable() == 0) data_.reset();
  }
  // Moves unread bytes to the front when the tail is full (rare: only after a partial drain).
  void make_room() {
    if (end_ == cap_ && start_ > 0) {
      std::memmove(data_.get(), data_.get() + start_, end_ - start_);
      end_ -= start_;
      start_ = 0;
    }
  }

 private:
  std::unique_ptr<char[]> data_;
  size_t cap_;
  size_t start_ = 0;
  size_t end_ = 0;
};

// What the connection makes of one direction's events: an interface the connection implements once per
// direction (one pointer in the direction, not a table of std::functions in every connection), and the
// forwarder's tests with a fake. Each returning bool gives false when the connection was closed (the
// direction must then not be touched).
class DirectionEvents {
 public:
  virtual ~DirectionEvents() = default;
  virtual void received(size_t n) = 0;  // bytes taken from the source (counted, activity)
  // The bytes themselves, when copied (a watcher of the stream; it must not change them). Default: unwatched.
  virtual void observe(std::string_view /*bytes*/) {}
  // For a watcher on a spliced direction: how many of the source's next bytes may pass unseen (spliced);
  // while it says fewer than Direction::kMinSplicedRun they are copied and shown to observe(). Default: any.
  virtual uint64_t splice_budget() const { return UINT64_MAX; }
  // That many bytes passed spliced, unseen (in order with what observe() was shown).
  virtual void passed_unseen(size_t /*n*/) {}
  virtual bool source_finished() = 0;           // the source sent its last byte (EOF, close_notify)
  virtual bool source_failed(IoResult r) = 0;   // always false
  virtual bool sink_failed(IoResult r) = 0;     // always false
  // May both ends splice now? (The request filter must read every client byte while requests come.)
  virtual bool may_splice() const = 0;
  // A direction whose ends could splice cannot after all (no pipe): its bytes are copied.
  virtual bool splice_refused(std::string why) = 0;
};

class Direction {
 public:
  // Moves all of `in` (what the source gave) into `out` (what goes to the sink); false when closed.
  using Stage = std::function<bool(std::string_view in, std::string& out)>;

  // `buffer` may already hold bytes from the source (the request head) that go first.
  // `events` outlives the direction.
  Direction(Transport* source, Transport* sink, ByteBuffer buffer, DirectionEvents& events);

  void set_stage(Stage stage) { stage_ = std::move(stage); }
  // Reads the source while there is room, passes the bytes through the stage, writes the sink; each
  // step only as far as it goes without blocking. False when the connection was closed.
  bool move();
  // Runs the stage alone (bytes already in the buffer, or frames the stage was given from elsewhere).
  bool run_stage();
  // Once the source finished and everything is delivered, tells the sink (FIN, close_notify).
  void shut_sink_when_done();

  // Nothing more is read from the source (its EOF, or a refusal that stops the direction).
  void stop_reading() {
    if (state_ == State::kMoving) state_ = State::kDraining;
  }
  bool source_done() const { return state_ != State::kMoving; }
  bool sink_shut() const { return state_ == State::kDone; }
  bool spliced() const { return splice_ == Splice::kRunning; }
  // Bytes taken from the source and not yet delivered to the sink.
  size_t pending() const { return buffer_.readable() + out_pending() + (pipe_ ? pipe_->buffered() : 0); }
  // The direction holds forwarding memory (a buffer, a staging string larger than kKeptStagingBytes, a pipe).
  bool holds_memory() const { return buffer_.holds_memory() || out_.capacity() > kKeptStagingBytes || pipe_; }
  // Waiting for the source (or done with it) with nothing in flight: the buffer, the staging string and the
  // splice pipe go back, so an idle connection holds no forwarding memory and no pipe. The connection calls
  // it once it has been quiet for a while (Connection::kReleaseIdleMemoryAfterMs), not after every burst: a
  // keep-alive client's next request reuses the memory instead of taking it from the allocator again.
  void release_memory_while_idle();
  // Reading the source can make progress.
  bool has_room() const;
  bool wants_source_readable() const { return state_ == State::kMoving && has_room(); }
  // poll() reported the source readable. Until then, after a read that would have blocked, the source is
  // not read again: an idle direction (the client during a download) costs no failed read per pump.
  void source_readable() { source_ready_ = true; }
  bool wants_sink_writable() const { return pending() > 0 || state_ == State::kDraining; }
  // The last read stopped for room while the source holds input poll() does not report.
  bool hidden_input() const {
    return read_filled_ && state_ == State::kMoving && !pipe_ && has_room() && source_->has_buffered_input();
  }

  // Per spliced direction. Pages in a pipe are pinned only while in flight, but a stalled reader keeps the
  // whole pipe full: 128 KiB (32 slots) moves eight TLS records per splice without letting 10k stalled
  // connections pin more than ~2.5 GiB.
  static constexpr size_t kSplicePipeBytes = 128 * 1024;
  // With a splice budget, fewer unseen bytes than this are copied (and shown) instead.
  static constexpr uint64_t kMinSplicedRun = 16 * 1024;
  // Staged bytes waiting to be sent before the source is read again.
  static constexpr size_t kMaxStagedBytes = 64 * 1024;
  // A staging string larger than this is freed while idle; a smaller one stays (it fits in the object).
  static constexpr size_t kKeptStagingBytes = 256;

 private:
  size_t out_pending() const { return out_.size() - out_sent_; }
  size_t queued() const { return stage_ ? out_pending() : buffer_.readable(); }
  bool fill();
  bool splice_from_source();
  bool write_sink();
  bool splice_to_sink();
  // Both ends can splice and the connection allows it: the pipe takes over (false when closed).
  bool start_splice_if_possible(bool* started);
  // While spliced, the watcher needs to see the next bytes (or so few may pass unseen that a splice would
  // cost more syscalls than a copy): they are read into the buffer, once the pipe has delivered what came
  // before them.
  bool copy_while_spliced() const { return events_.splice_budget() < kMinSplicedRun; }
  bool read_into_buffer();
  bool received(const IoResult& r);
  bool source_ended();

  Transport* source_;
  Transport* sink_;
  ByteBuffer buffer_;
  DirectionEvents& events_;
  Stage stage_;
  std::string out_;  // staged bytes for the sink; what was sent leaves the front (compact)
  size_t out_sent_ = 0;
  bool source_ready_ = true;  // the source may have input (see source_readable)
  // kMoving: the source is read. kDraining: it sent its last byte, what is left goes out. kDone: the sink
  // was told (FIN, close_notify).
  enum class State { kMoving, kDraining, kDone };
  State state_ = State::kMoving;
  // kCopying until both ends can splice and the connection allows it; kRefused when that failed (for good).
  enum class Splice { kCopying, kRunning, kRefused };
  Splice splice_ = Splice::kCopying;
  std::unique_ptr<SplicePipe> pipe_;  // set while kRunning, except while given back when idle
  bool read_filled_ = false;  // the last read stopped for room, not for want of input
  // splice stopped at a non-data TLS record while the pipe still held earlier bytes: the record is read
  // (recvmsg) only once those are delivered, so the order of the stream is kept.
  bool record_waits_ = false;
};

}  // namespace sg
