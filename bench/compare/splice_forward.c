// Floor for bench/compare/run.sh: a plain TCP forwarder (no TLS) that moves bytes with splice(2) through a
// pipe per direction, so payload never enters user space. One connection at a time, two threads per
// connection (one per direction), blocking sockets.
//   splice_forward LISTEN_PORT BACKEND_PORT      (both on 127.0.0.1)
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#define PIPE_BYTES (1 << 20)

struct dir {
  int from, to;
};

static void* pump(void* arg) {
  struct dir* d = arg;
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) return NULL;
  fcntl(p[1], F_SETPIPE_SZ, PIPE_BYTES);
  for (;;) {
    ssize_t n = splice(d->from, NULL, p[1], NULL, PIPE_BYTES, SPLICE_F_MOVE);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    while (n > 0) {
      ssize_t w = splice(p[0], NULL, d->to, NULL, (size_t)n, SPLICE_F_MOVE);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) goto out;
      n -= w;
    }
  }
out:
  shutdown(d->to, SHUT_WR);
  close(p[0]);
  close(p[1]);
  return NULL;
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s LISTEN_PORT BACKEND_PORT\n", argv[0]);
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(argv[1]))};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(ls, (struct sockaddr*)&a, sizeof a) != 0 || listen(ls, 64) != 0) {
    perror("splice_forward: bind/listen");
    return 1;
  }
  struct sockaddr_in b = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(argv[2]))};
  b.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  fprintf(stderr, "splice_forward listening on 127.0.0.1:%s -> 127.0.0.1:%s\n", argv[1], argv[2]);
  for (;;) {
    int c = accept(ls, NULL, NULL);
    if (c < 0) {
      if (errno == EINTR) continue;
      perror("splice_forward: accept");
      return 1;
    }
    int u = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(u, (struct sockaddr*)&b, sizeof b) != 0) {
      perror("splice_forward: connect");
      close(c);
      close(u);
      continue;
    }
    struct dir up = {c, u}, down = {u, c};
    pthread_t t1, t2;
    pthread_create(&t1, NULL, pump, &up);
    pthread_create(&t2, NULL, pump, &down);
    pthread_join(t1, NULL);
    pthread_join(t2, NULL);
    close(c);
    close(u);
  }
}
