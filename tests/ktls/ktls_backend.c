/* Backend for the kTLS guest test; runs in a sandbox.
 *   ktls_backend PORT        behind a raw TCP port. For each connection: skips the client's HTTP-like head
 *                            ("GET /?down=N ...", the test's own framing: the edge does not read it), reads
 *                            the client's bytes until EOF (the proxy's half-close), then answers
 *                            "<sha256 hex of those bytes> <count>\n" followed by N bytes of the test stream,
 *                            and closes.
 *   ktls_backend PORT http   behind an HTTP port: a keep-alive HTTP/1.1 server. GET /len/N answers N bytes of
 *                            the test stream with a Content-Length, /chunked/N the same in 100,000-byte
 *                            chunks; any other request (an Upgrade included) gets 404 with a short body. It
 *                            answers every request, pipelined ones too, and once the client has finished it
 *                            keeps its side open for 30 s, as a server that closes lazily does: whoever waits
 *                            for the sandbox's close waits that long.
 *   ktls_backend PORT http LINGER_SECS   the same, keeping its side open LINGER_SECS instead (the soak: 0). */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ktls_stream.h"

/* Buffers are malloc'd per connection, not static __thread: glibc zeroes a thread's static TLS block when it
 * starts the thread, so 144 KiB of them per thread would be resident for each of the soak's 10,000 held
 * connections. */
enum { kServeBuf = 1 << 16, kHttpIn = 1 << 14, kHttpOut = 1 << 16 };

static void* serve(void* arg) {
  int fd = (int)(intptr_t)arg;
  char* buf = malloc(kServeBuf);
  size_t have = 0;
  char* body = NULL;
  if (!buf) goto out;
  while (!body) {
    if (have == kServeBuf) goto out;
    ssize_t n = read(fd, buf + have, kServeBuf - have);
    if (n <= 0) goto out;
    have += (size_t)n;
    body = memmem(buf, have, "\r\n\r\n", 4);
  }
  unsigned long long down = 0;
  const char* q = memmem(buf, have, "down=", 5);
  if (q) down = strtoull(q + 5, NULL, 10);
  EVP_MD_CTX* md = EVP_MD_CTX_new();
  EVP_DigestInit_ex(md, EVP_sha256(), NULL);
  size_t head = (size_t)(body + 4 - buf);
  unsigned long long received = have - head;
  EVP_DigestUpdate(md, buf + head, have - head);
  for (;;) {
    ssize_t n = read(fd, buf, kServeBuf);
    if (n < 0) goto out;
    if (n == 0) break;
    received += (unsigned long long)n;
    EVP_DigestUpdate(md, buf, (size_t)n);
  }
  unsigned char digest[32];
  EVP_DigestFinal_ex(md, digest, NULL);
  EVP_MD_CTX_free(md);
  char line[128];
  int len = 0;
  for (int i = 0; i < 32; ++i) len += snprintf(line + len, sizeof line - len, "%02x", digest[i]);
  len += snprintf(line + len, sizeof line - len, " %llu\n", received);
  if (write_all(fd, line, (size_t)len) != 0) goto out;
  struct test_stream s;
  test_stream_init(&s, KTLS_DOWN_SEED);
  while (down > 0) {
    size_t n = down < kServeBuf ? (size_t)down : kServeBuf;
    test_stream_fill(&s, (unsigned char*)buf, n);
    if (write_all(fd, buf, n) != 0) goto out;
    down -= n;
  }
out:
  free(buf);
  close(fd);
  return NULL;
}

static int send_stream(int fd, char* buf, size_t cap, struct test_stream* s, unsigned long long n) {
  while (n > 0) {
    size_t k = n < cap ? (size_t)n : cap;
    test_stream_fill(s, (unsigned char*)buf, k);
    if (write_all(fd, buf, k) != 0) return -1;
    n -= k;
  }
  return 0;
}

static int answer_http(int fd, const char* head, char* buf, size_t cap) {
  unsigned long long n = 0;
  char line[128];
  struct test_stream s;
  test_stream_init(&s, KTLS_DOWN_SEED);
  if (sscanf(head, "GET /len/%llu ", &n) == 1) {
    int len = snprintf(line, sizeof line, "HTTP/1.1 200 OK\r\nContent-Length: %llu\r\n\r\n", n);
    return write_all(fd, line, (size_t)len) == 0 ? send_stream(fd, buf, cap, &s, n) : -1;
  }
  if (sscanf(head, "GET /chunked/%llu ", &n) == 1) {
    static const char start[] = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n";
    if (write_all(fd, start, sizeof start - 1) != 0) return -1;
    while (n > 0) {
      unsigned long long k = n < 100000 ? n : 100000;
      int len = snprintf(line, sizeof line, "%llx\r\n", k);
      if (write_all(fd, line, (size_t)len) != 0 || send_stream(fd, buf, cap, &s, k) != 0 || write_all(fd, "\r\n", 2) != 0)
        return -1;
      n -= k;
    }
    return write_all(fd, "0\r\n\r\n", 5);
  }
  static const char missing[] = "HTTP/1.1 404 Not Found\r\nContent-Length: 10\r\n\r\nnot found\n";
  return write_all(fd, missing, sizeof missing - 1);
}

static unsigned linger_secs = 30;

static void* serve_http(void* arg) {
  int fd = (int)(intptr_t)arg;
  char* in = malloc(kHttpIn);
  char* out = malloc(kHttpOut);
  size_t have = 0;
  if (!in || !out) goto out;
  for (;;) {
    char* end;
    while ((end = memmem(in, have, "\r\n\r\n", 4)) != NULL) {  /* no request here has a body */
      *end = 0;
      if (answer_http(fd, in, out, kHttpOut) != 0) goto out;
      size_t used = (size_t)(end + 4 - in);
      memmove(in, in + used, have - used);
      have -= used;
    }
    if (have == kHttpIn) goto out;
    ssize_t n = read(fd, in + have, kHttpIn - have);
    if (n < 0) goto out;
    if (n == 0) break;
    have += (size_t)n;
  }
  sleep(linger_secs);
out:
  free(in);
  free(out);
  close(fd);
  return NULL;
}

int main(int argc, char** argv) {
  if (argc < 2 || argc > 4 || (argc >= 3 && strcmp(argv[2], "http") != 0)) {
    fprintf(stderr, "usage: %s PORT [http [LINGER_SECS]]\n", argv[0]);
    return 2;
  }
  void* (*handler)(void*) = argc >= 3 ? serve_http : serve;
  if (argc == 4) linger_secs = (unsigned)strtoul(argv[3], NULL, 10);
  signal(SIGPIPE, SIG_IGN);
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(argv[1]))};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(ls, (struct sockaddr*)&a, sizeof a) != 0 || listen(ls, 16) != 0) {
    perror("ktls_backend: bind/listen");
    return 1;
  }
  for (;;) {
    int c = accept(ls, NULL, NULL);
    if (c < 0) continue;
    pthread_t t;
    if (pthread_create(&t, NULL, handler, (void*)(intptr_t)c) == 0) pthread_detach(t);
    else close(c);
  }
}
