// Rotates the process's session ticket keys (proxy/ticket_keys.h) on a timer of the main thread's loop. The
// period is asked for before each wait, so a reload's proxy.tls_ticket_key_rotation_secs applies from the next
// rotation on.
#pragma once

#include <uv.h>

#include <cstdint>
#include <functional>
#include <memory>

#include "proxy/ticket_keys.h"

namespace sg {

class TicketKeyRotation {
 public:
  using PeriodMs = std::function<uint64_t()>;

  TicketKeyRotation(uv_loop_t* loop, std::shared_ptr<TicketKeys> keys, PeriodMs period_ms);
  ~TicketKeyRotation();
  TicketKeyRotation(const TicketKeyRotation&) = delete;
  TicketKeyRotation& operator=(const TicketKeyRotation&) = delete;

  void start();
  uint64_t rotations() const { return rotations_; }

 private:
  void schedule();
  void on_timer();

  std::shared_ptr<TicketKeys> keys_;
  PeriodMs period_ms_;
  uv_timer_t* timer_;  // freed in its close callback
  uint64_t rotations_ = 0;
};

}  // namespace sg
