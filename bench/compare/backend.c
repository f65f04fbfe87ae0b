// Bulk-transfer backend for bench/compare/run.sh (plain TCP, HTTP/1.1-shaped, one connection at a time).
//   backend ADDR PORT
// Reads a request head, then:
//   GET /dl/N ...            -> "200" head with Content-Length: N, then N zero bytes, then FIN.
//   anything else (PUT/POST) -> reads Content-Length bytes of body (or until EOF without one) and replies
//                               with the count as the body.
// Deliberately cheap: 256 KiB writes from a zero buffer, 256 KiB reads, no parsing beyond the head.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#define CHUNK (256 * 1024)
static char buf[CHUNK];
static char zeros[CHUNK];

static int write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

static long long header_value(const char* head, const char* name) {
  size_t len = strlen(name);
  for (const char* p = head; (p = strstr(p, "\r\n")) != NULL;) {
    p += 2;
    if (strncasecmp(p, name, len) == 0 && p[len] == ':') return atoll(p + len + 1);
  }
  return -1;
}

static void serve(int fd) {
  size_t have = 0;
  char* end = NULL;
  while (!end) {
    if (have >= sizeof buf - 1) return;
    ssize_t n = recv(fd, buf + have, sizeof buf - 1 - have, 0);
    if (n <= 0) return;
    have += (size_t)n;
    buf[have] = 0;
    end = strstr(buf, "\r\n\r\n");
  }
  size_t head_len = (size_t)(end + 4 - buf);
  char head[4096];
  snprintf(head, sizeof head, "%.*s", (int)(head_len < sizeof head ? head_len : sizeof head - 1), buf);
  if (strncmp(head, "GET ", 4) == 0) {
    long long total = 0;
    if (strncmp(head + 4, "/dl/", 4) == 0) total = atoll(head + 8);
    char resp[256];
    int m = snprintf(resp, sizeof resp,
                     "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: %lld\r\n"
                     "Connection: close\r\n\r\n",
                     total);
    if (write_all(fd, resp, (size_t)m) != 0) return;
    while (total > 0) {
      size_t n = total < CHUNK ? (size_t)total : CHUNK;
      if (write_all(fd, zeros, n) != 0) return;
      total -= (long long)n;
    }
  } else {
    long long want = header_value(head, "content-length");
    if (strcasestr(head, "\r\nexpect: 100-continue")) {
      const char* cont = "HTTP/1.1 100 Continue\r\n\r\n";
      if (write_all(fd, cont, strlen(cont)) != 0) return;
    }
    long long got = (long long)(have - head_len);
    while (want < 0 || got < want) {
      ssize_t n = recv(fd, buf, sizeof buf, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += n;
    }
    char body[64], resp[256];
    int bl = snprintf(body, sizeof body, "%lld\n", got);
    int m = snprintf(resp, sizeof resp,
                     "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
                     bl, body);
    if (write_all(fd, resp, (size_t)m) != 0) return;
  }
  // Orderly close: FIN, then drain until the peer closes, so the last bytes are never lost to a RST.
  shutdown(fd, SHUT_WR);
  while (recv(fd, buf, sizeof buf, 0) > 0) {
  }
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s ADDR PORT\n", argv[0]);
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(argv[2]))};
  if (inet_pton(AF_INET, argv[1], &a.sin_addr) != 1 || bind(ls, (struct sockaddr*)&a, sizeof a) != 0 ||
      listen(ls, 64) != 0) {
    perror("backend: bind/listen");
    return 1;
  }
  fprintf(stderr, "backend listening on %s:%s\n", argv[1], argv[2]);
  for (;;) {
    int fd = accept(ls, NULL, NULL);
    if (fd < 0) {
      if (errno == EINTR) continue;
      perror("backend: accept");
      return 1;
    }
    serve(fd);
    close(fd);
  }
}
