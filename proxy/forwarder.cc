#include "proxy/forwarder.h"

namespace sg {
namespace {

// A staged direction's queue: what was sent leaves the front, so the queue never grows with the bytes a
// connection moves, and an emptied queue gives back memory beyond 32 KiB, so an idle connection after an
// upload does not keep it.
constexpr size_t kKeptQueueBytes = 32 * 1024;
void compact(std::string& queue, size_t& sent) {
  if (sent == 0) return;
  if (sent == queue.size()) {
    if (queue.capacity() > kKeptQueueBytes) std::string().swap(queue);
    else queue.clear();
  } else if (sent >= kKeptQueueBytes) {
    queue.erase(0, sent);  // moves less than kMaxStagedBytes
  } else {
    return;
  }
  sent = 0;
}

}  // namespace

Direction::Direction(Transport* source, Transport* sink, ByteBuffer buffer, DirectionEvents& events)
    : source_(source), sink_(sink), buffer_(std::move(buffer)), events_(events) {}

bool Direction::has_room() const {
  // Spliced bytes go out only after what the buffer holds (the request head), so the pipe fills once the
  // buffer is empty.
  if (pipe_) {
    if (out_pending() > 0 || record_waits_) return false;
    if (copy_while_spliced()) return pipe_->buffered() == 0 && buffer_.space() > 0;
    return buffer_.readable() == 0 && pipe_->accepts_more();
  }
  return buffer_.space() > 0 && out_pending() < kMaxStagedBytes;
}

// Moves bytes one step each way it can; polling is level-triggered, so a step that stops early loses nothing.
bool Direction::move() {
  if (state_ == State::kMoving && has_room() && !fill()) return false;
  if (!run_stage()) return false;
  if (queued() > 0 && !write_sink()) return false;
  if (pipe_ && pipe_->buffered() > 0 && !splice_to_sink()) return false;
  return true;
}

void Direction::release_memory_while_idle() {
  // A source that may be read again keeps what its next read needs; one that ended is never read again (the
  // read that saw its EOF took the buffer, and a half-closed connection may stay open for long).
  if (state_ == State::kMoving && (source_ready_ || source_->has_buffered_input())) return;
  buffer_.release();
  if (out_pending() == 0 && out_.capacity() > kKeptStagingBytes) {
    std::string().swap(out_);
    out_sent_ = 0;
  }
  // An empty pipe is two descriptors and a kernel pipe per idle kTLS connection; the next bytes take a new one.
  // Only with nothing else in flight: what the buffer or the staging string holds goes out before anything a
  // new pipe takes (fill() waits for it, as at the first splice).
  if (pipe_ && pending() == 0 && !record_waits_) pipe_.reset();
}

bool Direction::run_stage() {
  if (!stage_) return true;
  compact(out_, out_sent_);
  std::string_view in(buffer_.read_ptr(), buffer_.readable());
  const size_t n = in.size();
  if (!stage_(in, out_)) return false;
  buffer_.consumed(n);
  return true;
}

bool Direction::start_splice_if_possible(bool* started) {
  *started = false;
  if (splice_ != Splice::kCopying || !source_->can_splice_in() || !sink_->can_splice_out() || !events_.may_splice())
    return true;
  auto pipe = SplicePipe::create(kSplicePipeBytes);
  if (!pipe) {
    splice_ = Splice::kRefused;
    return events_.splice_refused("no pipe to splice through: " + pipe.message());
  }
  pipe_ = std::move(*pipe);
  splice_ = Splice::kRunning;
  *started = true;
  return true;
}

bool Direction::fill() {
  if (splice_ == Splice::kCopying) {
    bool started = false;
    if (!start_splice_if_possible(&started)) return false;
    // The pipe fills only once the buffer is delivered.
    if (started && !has_room()) return true;
  }
  const bool buffered = source_->has_buffered_input();
  if (!source_ready_ && !buffered) return true;
  if (splice_ == Splice::kRunning && !pipe_) {
    // Given back while idle. Without a pipe now (descriptors short for a moment) these bytes are copied and
    // the next ones ask again: the connection is no less offloaded for it.
    if (auto pipe = SplicePipe::create(kSplicePipeBytes)) pipe_ = std::move(*pipe);
    if (!has_room()) return true;  // the buffer is delivered first
  }
  // Input the transport holds came off the socket before what a splice would take now.
  if (pipe_ && !copy_while_spliced() && !buffered) return splice_from_source();
  return read_into_buffer();
}

bool Direction::read_into_buffer() {
  buffer_.make_room();
  const char* fresh = buffer_.write_ptr();
  IoResult r = source_->read(std::span<char>(buffer_.write_ptr(), buffer_.space()));
  buffer_.produced(r.bytes);
  if (r.bytes > 0) events_.observe(std::string_view(fresh, r.bytes));
  read_filled_ = r.status == IoResult::Status::kOk && !r.drained;
  return received(r);
}

bool Direction::received(const IoResult& r) {
  if ((r.status == IoResult::Status::kWouldBlock && !r.waits_for_writable) || r.drained) source_ready_ = false;
  if (r.bytes > 0) events_.received(r.bytes);
  switch (r.status) {
    case IoResult::Status::kOk:
    case IoResult::Status::kWouldBlock:
      return true;
    case IoResult::Status::kEof:
      return source_ended();
    case IoResult::Status::kNotData:
    case IoResult::Status::kError:
      break;
  }
  return events_.source_failed(r);
}

bool Direction::source_ended() {
  if (!events_.source_finished()) return false;
  stop_reading();
  return true;
}

bool Direction::splice_from_source() {
  const uint64_t budget = events_.splice_budget();
  IoResult r = source_->splice_in(*pipe_, budget);
  if (r.bytes > 0) events_.passed_unseen(r.bytes);
  if (r.status != IoResult::Status::kNotData) return received(r);
  // Read (into the buffer, empty while splicing) once the pipe has delivered what came before it.
  if (pipe_->buffered() == 0) return read_into_buffer();
  record_waits_ = true;
  return true;
}

bool Direction::write_sink() {
  const char* data = stage_ ? out_.data() + out_sent_ : buffer_.read_ptr();
  IoResult r = sink_->write(std::span<const char>(data, queued()));
  if (r.status == IoResult::Status::kError) return events_.sink_failed(std::move(r));
  if (stage_) {
    out_sent_ += r.bytes;
    compact(out_, out_sent_);
  } else {
    buffer_.consumed(r.bytes);
  }
  return true;
}

bool Direction::splice_to_sink() {
  IoResult r = sink_->splice_out(*pipe_);
  if (r.status == IoResult::Status::kError) return events_.sink_failed(std::move(r));
  if (pipe_->buffered() == 0) record_waits_ = false;
  return true;
}

void Direction::shut_sink_when_done() {
  if (state_ == State::kDraining && pending() == 0 && sink_->shutdown_write()) state_ = State::kDone;
}

}  // namespace sg
