// Freeing heap-allocated libuv handles. libuv frees nothing itself: a handle's memory must outlive
// uv_close() until its close callback runs, so the callback deletes it.
#pragma once

#include <uv.h>

namespace sg {

// Closes and later deletes `handle` (a `new`-ed uv_timer_t, uv_poll_t, ...), and nulls the caller's pointer
// and the handle's data so nothing reaches its owner any more. Null-safe.
template <typename Handle>
void close_and_free(Handle*& handle) {
  if (handle == nullptr) return;
  handle->data = nullptr;
  uv_close(reinterpret_cast<uv_handle_t*>(handle), [](uv_handle_t* h) { delete reinterpret_cast<Handle*>(h); });
  handle = nullptr;
}

}  // namespace sg
