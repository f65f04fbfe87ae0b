// Backend for the bench/compare benchmarks (plain TCP, HTTP/1.1-shaped).
//   backend ADDR PORT        bulk (run.sh): one connection at a time. Reads a request head, then:
//     GET /dl/N ...            -> "200" head with Content-Length: N, then N zero bytes, then FIN.
//     anything else (PUT/POST) -> reads Content-Length bytes of body (or until EOF without one) and replies
//                                 with the count as the body.
//     Deliberately cheap: 256 KiB writes from a zero buffer, 256 KiB reads, no parsing beyond the head.
//   backend ADDR PORT small  small requests (connections.sh): many connections at once (one epoll loop),
//     keep-alive. GET /dl/N with N <= 64 KiB -> one write of the head and N zero bytes; a request that says
//     "Connection: close" is answered with it, then FIN. Anything else -> 400 and close.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
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

// ---- small mode ----
#define SMALL_MAX_BODY (64 * 1024)
#define SMALL_MAX_CONNS 65536
struct small_conn {
  char in[4096];
  size_t have;
  char* out;  // unsent answer bytes (a write the socket did not take whole)
  size_t out_len, out_off;
  int closing;  // answered a "Connection: close" request: FIN after the answer, then wait for the peer
  int shut;     // that FIN went: shutting down again would wake this socket's epoll entry (a busy loop)
};
static struct small_conn* conns[SMALL_MAX_CONNS];
static char answer[SMALL_MAX_BODY + 256];

static void small_close(int ep, int fd) {
  epoll_ctl(ep, EPOLL_CTL_DEL, fd, NULL);
  close(fd);
  free(conns[fd]->out);
  free(conns[fd]);
  conns[fd] = NULL;
}

// Sends what is pending; 0 when all of it went, 1 when the socket is full, -1 on error.
static int small_flush(struct small_conn* c, int fd) {
  while (c->out_off < c->out_len) {
    ssize_t w = send(fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
    if (w < 0) return errno == EAGAIN ? 1 : -1;
    c->out_off += (size_t)w;
  }
  free(c->out);
  c->out = NULL;
  c->out_len = c->out_off = 0;
  return 0;
}

// Answers every complete head in c->in; -1 to close the connection.
static int small_answer(struct small_conn* c, int fd) {
  char* end;
  while (!c->closing && c->out == NULL && (end = memmem(c->in, c->have, "\r\n\r\n", 4)) != NULL) {
    size_t head_len = (size_t)(end + 4 - c->in);
    end[2] = 0;  // the head as a string, for the searches below (its last CRLF is not needed)
    long long n = -1;
    if (strncmp(c->in, "GET /dl/", 8) == 0) n = atoll(c->in + 8);
    if (n < 0 || n > SMALL_MAX_BODY) {
      const char* bad = "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
      send(fd, bad, strlen(bad), MSG_NOSIGNAL);
      return -1;
    }
    c->closing = strcasestr(c->in, "\r\nconnection: close") != NULL;
    int m = snprintf(answer, sizeof answer,
                     "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: %lld\r\n%s\r\n",
                     n, c->closing ? "Connection: close\r\n" : "");
    memset(answer + m, 0, (size_t)n);
    size_t len = (size_t)m + (size_t)n;
    memmove(c->in, c->in + head_len, c->have - head_len);
    c->have -= head_len;
    ssize_t w = send(fd, answer, len, MSG_NOSIGNAL);
    if (w < 0 && errno != EAGAIN) return -1;
    if (w < 0) w = 0;
    if ((size_t)w < len) {  // the rest waits for EPOLLOUT
      c->out = malloc(len - (size_t)w);
      if (!c->out) return -1;
      memcpy(c->out, answer + w, len - (size_t)w);
      c->out_len = len - (size_t)w;
    }
  }
  if (c->closing && c->out == NULL && !c->shut) {
    shutdown(fd, SHUT_WR);
    c->shut = 1;
  }
  return 0;
}

static int serve_small(int ls) {
  int ep = epoll_create1(0);
  struct epoll_event ev = {.events = EPOLLIN, .data.fd = ls};
  if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, ls, &ev) != 0) {
    perror("backend: epoll");
    return 1;
  }
  struct epoll_event ready[256];
  for (;;) {
    int k = epoll_wait(ep, ready, 256, -1);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) {
      perror("backend: epoll_wait");
      return 1;
    }
    for (int i = 0; i < k; ++i) {
      int fd = ready[i].data.fd;
      if (fd == ls) {
        int c;
        while ((c = accept4(ls, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
          if (c >= SMALL_MAX_CONNS || !(conns[c] = calloc(1, sizeof **conns))) {
            close(c);
            continue;
          }
          int one = 1;
          setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
          struct epoll_event cev = {.events = EPOLLIN | EPOLLOUT | EPOLLET, .data.fd = c};
          epoll_ctl(ep, EPOLL_CTL_ADD, c, &cev);
        }
        continue;
      }
      struct small_conn* c = conns[fd];
      if (!c) continue;
      int failed = 0;
      if (c->out && small_flush(c, fd) < 0) failed = 1;
      // Edge-triggered: read until the socket is empty.
      while (!failed) {
        if (c->have == sizeof c->in) {  // a head larger than the buffer
          failed = 1;
          break;
        }
        ssize_t n = recv(fd, c->in + c->have, sizeof c->in - c->have, 0);
        if (n > 0) {
          c->have += (size_t)n;
          continue;
        }
        if (n == 0 || errno != EAGAIN) failed = 1;  // the peer closed (or reset)
        break;
      }
      if (failed || small_answer(c, fd) < 0) small_close(ep, fd);
    }
  }
}

int main(int argc, char** argv) {
  if (argc != 3 && !(argc == 4 && strcmp(argv[3], "small") == 0)) {
    fprintf(stderr, "usage: %s ADDR PORT [small]\n", argv[0]);
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(argv[2]))};
  if (inet_pton(AF_INET, argv[1], &a.sin_addr) != 1 || bind(ls, (struct sockaddr*)&a, sizeof a) != 0 ||
      listen(ls, 1024) != 0) {
    perror("backend: bind/listen");
    return 1;
  }
  fprintf(stderr, "backend listening on %s:%s%s\n", argv[1], argv[2], argc == 4 ? " (small)" : "");
  if (argc == 4) {
    int flags = 1;
    ioctl(ls, FIONBIO, &flags);
    return serve_small(ls);
  }
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
