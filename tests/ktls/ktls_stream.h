/* The deterministic byte stream the kTLS guest test sends each way (xorshift64*), so both ends can check
 * every byte without storing the 64 MiB; and the blocking write both ends send it with. */
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define KTLS_UP_SEED 0x9e3779b97f4a7c15ULL
#define KTLS_DOWN_SEED 0xd1b54a32d192ed03ULL

struct test_stream {
  uint64_t state;
};

static inline void test_stream_init(struct test_stream* s, uint64_t seed) { s->state = seed; }

/* Callers pass lengths that are multiples of 8 except for the last piece of a stream. */
static inline void test_stream_fill(struct test_stream* s, unsigned char* out, size_t n) {
  while (n > 0) {
    s->state ^= s->state >> 12;
    s->state ^= s->state << 25;
    s->state ^= s->state >> 27;
    uint64_t v = s->state * 0x2545f4914f6cdd1dULL;
    size_t k = n < 8 ? n : 8;
    memcpy(out, &v, k);
    out += k;
    n -= k;
  }
}

/* All n bytes to a blocking descriptor; -1 on an error or a write that took nothing. */
static inline int write_all(int fd, const void* data, size_t n) {
  const unsigned char* p = (const unsigned char*)data;
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w <= 0) return -1;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}
