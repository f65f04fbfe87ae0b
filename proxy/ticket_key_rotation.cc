#include "proxy/ticket_key_rotation.h"

#include "common/log.h"

namespace sg {

TicketKeyRotation::TicketKeyRotation(uv_loop_t* loop, std::shared_ptr<TicketKeys> keys, PeriodMs period_ms)
    : keys_(std::move(keys)), period_ms_(std::move(period_ms)), timer_(new uv_timer_t) {
  uv_timer_init(loop, timer_);
  timer_->data = this;
}

TicketKeyRotation::~TicketKeyRotation() {
  uv_close(reinterpret_cast<uv_handle_t*>(timer_), [](uv_handle_t* h) { delete reinterpret_cast<uv_timer_t*>(h); });
}

void TicketKeyRotation::start() { schedule(); }

void TicketKeyRotation::schedule() {
  uv_timer_start(timer_, [](uv_timer_t* t) { static_cast<TicketKeyRotation*>(t->data)->on_timer(); }, period_ms_(), 0);
}

void TicketKeyRotation::on_timer() {
  if (Status s = keys_->rotate(); !s) spdlog::warn("session ticket key rotation: {} (the current key stays)", s.message());
  else ++rotations_;
  schedule();
}

}  // namespace sg
