/* TLS client for the kTLS guest test. Sends a request head and UP bytes of the test stream, then
 * close_notify (a half-close: it keeps reading), and checks the answer: the sha256 and count of what it
 * sent, DOWN bytes of the test stream, then a clean close_notify from the proxy.
 *   ktls_client PORT SNI CA_FILE 1.2|1.3 CIPHER UP DOWN [keyupdate|alert]
 * CIPHER is an OpenSSL cipher (1.2) or ciphersuite (1.3) name. With "keyupdate" the client sends a TLS 1.3
 * KeyUpdate halfway through the upload and expects the proxy to close the connection. With "alert" it sends
 * a fatal internal_error alert there instead (OpenSSL has no call for that, so the client's own transmit is
 * offloaded to the kernel and the alert goes out as a record of type 21 through TLS_SET_RECORD_TYPE).
 *   ktls_client PORT SNI CA_FILE 1.2|1.3 CIPHER 0 DOWN pipeline OTHER_HOST
 * sends four pipelined requests to an HTTP port (ktls_backend's http mode) in one write: GET /len/DOWN,
 * GET /chunked/DOWN, an Upgrade the backend refuses (404), and one whose Host is OTHER_HOST. It expects both
 * bodies intact, the 404, then 421 from the edge and the connection closed by it within 10 s of the second
 * body, although the backend keeps its side open for 30 s.
 *   ktls_client PORT SNI CA_FILE 1.2|1.3 CIPHER 0 DOWN hold N
 * opens N connections to an HTTP port, gets GET /len/DOWN on each (checked), prints "ok held N" and keeps them
 * all open and quiet until it is killed: the idle connections whose memory the bench measures.
 *   ktls_client PORT SNI CA_FILE 1.3 TLS_AES_128_GCM_SHA256 UP DOWN empty
 * the transfer, with the client's records sealed by this program instead of OpenSSL (the key from the keylog
 * callback), so that it can send what OpenSSL and the kernel never send: an empty application-data record
 * right after the head and another halfway through the upload. The proxy must step over them, not take
 * them for the end of the stream (Linux's splice from a kTLS socket returns 0 for one, as at EOF).
 *   ktls_client PORT SNI CA_FILE 1.2|1.3 CIPHER UP DOWN resume
 * first makes a connection that only does its handshake and ends with close_notify, then the transfer on a
 * second one that offers the first's session by its ID (no tickets); adds "resumed=0|1" to the line.
 * Prints one line "ok ..." or "error: ..." and exits 0 or 1. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>
#include <openssl/ssl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/tls.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "ktls_stream.h"

#define CHUNK (1 << 16)

#ifndef SOL_TLS
#define SOL_TLS 282
#endif

/* Sends one alert record {level, description} through the kernel's TLS transmit path. */
static int send_alert_record(int fd, unsigned char level, unsigned char description) {
  unsigned char alert[2] = {level, description};
  char control[CMSG_SPACE(sizeof(unsigned char))];
  memset(control, 0, sizeof control);
  struct iovec iov = {.iov_base = alert, .iov_len = sizeof alert};
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control, .msg_controllen = sizeof control};
  struct cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
  cmsg->cmsg_level = SOL_TLS;
  cmsg->cmsg_type = TLS_SET_RECORD_TYPE;
  cmsg->cmsg_len = CMSG_LEN(sizeof(unsigned char));
  *CMSG_DATA(cmsg) = 21; /* alert */
  return sendmsg(fd, &msg, 0) == (ssize_t)sizeof alert ? 0 : -1;
}

/* The "empty" mode's own TLS 1.3 record writer (AES-128-GCM): the client's application traffic secret from
 * the keylog callback, HKDF-Expand-Label for the key and IV (RFC 8446 7.1, 7.3), one sealed record per call. */
static unsigned char client_secret[32];
static int have_client_secret;

static void keylog(const SSL* ssl, const char* line) {
  (void)ssl;
  static const char label[] = "CLIENT_TRAFFIC_SECRET_0 ";
  if (strncmp(line, label, sizeof label - 1) != 0) return;
  const char* hex = strchr(line + sizeof label - 1, ' ');
  if (!hex || strlen(hex + 1) != 64) return;
  for (int i = 0; i < 32; ++i) sscanf(hex + 1 + 2 * i, "%2hhx", &client_secret[i]);
  have_client_secret = 1;
}

static int expand_label(const unsigned char* secret, const char* label, unsigned char* out, size_t len) {
  unsigned char info[64];
  size_t label_len = strlen(label);
  info[0] = 0;
  info[1] = (unsigned char)len;
  info[2] = (unsigned char)(6 + label_len);
  memcpy(info + 3, "tls13 ", 6);
  memcpy(info + 9, label, label_len);
  info[9 + label_len] = 0; /* empty context */
  EVP_PKEY_CTX* pctx = EVP_PKEY_CTX_new_id(EVP_PKEY_HKDF, NULL);
  int ok = pctx && EVP_PKEY_derive_init(pctx) > 0 &&
           EVP_PKEY_CTX_set_hkdf_mode(pctx, EVP_PKEY_HKDEF_MODE_EXPAND_ONLY) > 0 &&
           EVP_PKEY_CTX_set_hkdf_md(pctx, EVP_sha256()) > 0 && EVP_PKEY_CTX_set1_hkdf_key(pctx, secret, 32) > 0 &&
           EVP_PKEY_CTX_add1_hkdf_info(pctx, info, (int)(10 + label_len)) > 0 && EVP_PKEY_derive(pctx, out, &len) > 0;
  EVP_PKEY_CTX_free(pctx);
  return ok ? 0 : -1;
}

struct sealer {
  int fd;
  unsigned char key[16], iv[12];
  unsigned long long seq;
};

/* One record: n <= 16384 bytes of content of the given inner type (0 bytes is the empty record). */
static int seal_record(struct sealer* w, unsigned char type, const unsigned char* data, size_t n) {
  static unsigned char record[5 + 16384 + 1 + 16];
  size_t inner = n + 1, body = inner + 16;
  record[0] = 23;
  record[1] = 3;
  record[2] = 3;
  record[3] = (unsigned char)(body >> 8);
  record[4] = (unsigned char)body;
  memcpy(record + 5, data, n);
  record[5 + n] = type;
  unsigned char nonce[12];
  memcpy(nonce, w->iv, 12);
  for (int i = 0; i < 8; ++i) nonce[11 - i] ^= (unsigned char)(w->seq >> (8 * i));
  EVP_CIPHER_CTX* c = EVP_CIPHER_CTX_new();
  int len = 0, ok = EVP_EncryptInit_ex(c, EVP_aes_128_gcm(), NULL, w->key, nonce) == 1 &&
                    EVP_EncryptUpdate(c, NULL, &len, record, 5) == 1 &&
                    EVP_EncryptUpdate(c, record + 5, &len, record + 5, (int)inner) == 1 &&
                    EVP_EncryptFinal_ex(c, record + 5 + len, &len) == 1 &&
                    EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_GET_TAG, 16, record + 5 + inner) == 1;
  EVP_CIPHER_CTX_free(c);
  ++w->seq;
  return ok ? write_all(w->fd, record, 5 + body) : -1;
}

static int seal_all(struct sealer* w, const unsigned char* p, size_t n) {
  while (n > 0) {
    size_t k = n < 16384 ? n : 16384;
    if (seal_record(w, 23, p, k) != 0) return -1;
    p += k;
    n -= k;
  }
  return 0;
}

static int fail(const char* what) {
  char err[256];
  ERR_error_string_n(ERR_get_error(), err, sizeof err);
  printf("error: %s (%s)\n", what, err);
  return 1;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static int ssl_write_all(SSL* ssl, const unsigned char* p, size_t n) {
  while (n > 0) {
    int w = SSL_write(ssl, p, (int)n);
    if (w <= 0) return -1;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

/* Where the pipelined case is, for the line a timeout's SIGTERM prints: a hang then says what never came. */
static const char* volatile pipeline_stage = "connecting";
static volatile unsigned long long pipeline_bytes;

static void killed_while_waiting(int sig) {
  (void)sig;
  char line[160];
  int n = snprintf(line, sizeof line, "error: killed while waiting for %s, %llu bytes read\n", pipeline_stage, pipeline_bytes);
  if (n > 0) (void)!write(1, line, (size_t)n);
  _exit(1);
}

/* Reads exactly n bytes (fewer only at the end of the stream). */
static size_t ssl_read_full(SSL* ssl, unsigned char* p, size_t n) {
  size_t got = 0;
  while (got < n) {
    int r = SSL_read(ssl, p + got, (int)(n - got));
    if (r <= 0) break;
    got += (size_t)r;
    pipeline_bytes += (unsigned long long)r;
  }
  return got;
}

/* One response head, up to and including its blank line (read a byte at a time: heads are short). */
static int read_head(SSL* ssl, char* head, size_t cap) {
  size_t n = 0;
  while (n + 1 < cap) {
    if (SSL_read(ssl, head + n, 1) != 1) return -1;
    ++n;
    ++pipeline_bytes;
    if (n >= 4 && memcmp(head + n - 4, "\r\n\r\n", 4) == 0) {
      head[n] = 0;
      return 0;
    }
  }
  return -1;
}

/* n bytes of the download stream, checked against `s`. */
static int read_stream(SSL* ssl, struct test_stream* s, unsigned long long n) {
  static unsigned char buf[CHUNK], expect[CHUNK];
  while (n > 0) {
    size_t k = n < CHUNK ? (size_t)n : CHUNK;
    test_stream_fill(s, expect, k);
    if (ssl_read_full(ssl, buf, k) != k || memcmp(buf, expect, k) != 0) return -1;
    n -= k;
  }
  return 0;
}

static int pipeline(SSL* ssl, const char* sni, const char* other, unsigned long long down) {
  char requests[1024], head[4096];
  int len = snprintf(requests, sizeof requests,
                     "GET /len/%llu HTTP/1.1\r\nHost: %s\r\n\r\n"
                     "GET /chunked/%llu HTTP/1.1\r\nHost: %s\r\n\r\n"
                     "GET /ws HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
                     "GET / HTTP/1.1\r\nHost: %s\r\n\r\n",
                     down, sni, down, sni, sni, other);
  signal(SIGTERM, killed_while_waiting);
  pipeline_stage = "the first answer";
  if (ssl_write_all(ssl, (const unsigned char*)requests, (size_t)len) != 0) return fail("write requests");
  struct test_stream s;
  double start = now_s();
  test_stream_init(&s, KTLS_DOWN_SEED);
  if (read_head(ssl, head, sizeof head) != 0 || strncmp(head, "HTTP/1.1 200", 12) != 0)
    return printf("error: first answer: %s\n", head), 1;
  pipeline_stage = "the Content-Length body";
  if (read_stream(ssl, &s, down) != 0) return printf("error: the Content-Length body is not the stream\n"), 1;
  pipeline_stage = "the second answer";
  if (read_head(ssl, head, sizeof head) != 0 || strncmp(head, "HTTP/1.1 200", 12) != 0 || !strstr(head, "chunked"))
    return printf("error: second answer: %s\n", head), 1;
  test_stream_init(&s, KTLS_DOWN_SEED);
  pipeline_stage = "the chunked body";
  for (;;) {
    char line[32];
    size_t n = 0;
    while (n + 1 < sizeof line && SSL_read(ssl, line + n, 1) == 1 && line[n] != '\n') ++n;
    line[n] = 0;
    unsigned long long size = strtoull(line, NULL, 16);
    if (size == 0) break;
    if (read_stream(ssl, &s, size) != 0 || ssl_read_full(ssl, (unsigned char*)line, 2) != 2)
      return printf("error: the chunked body is not the stream\n"), 1;
  }
  char crlf[2];
  if (ssl_read_full(ssl, (unsigned char*)crlf, 2) != 2) return printf("error: chunked body not ended\n"), 1;
  double bodies = now_s();
  pipeline_stage = "the 404 to the Upgrade";
  if (read_head(ssl, head, sizeof head) != 0 || strncmp(head, "HTTP/1.1 404", 12) != 0)
    return printf("error: the refused Upgrade's answer: %s\n", head), 1;
  char body[16];
  if (ssl_read_full(ssl, (unsigned char*)body, 10) != 10) return printf("error: the 404's body\n"), 1;
  pipeline_stage = "the 421";
  if (read_head(ssl, head, sizeof head) != 0 || strncmp(head, "HTTP/1.1 421", 12) != 0)
    return printf("error: the request for %s got, instead of 421: %s\n", other, head), 1;
  pipeline_stage = "the close after the 421";
  static unsigned char rest[CHUNK];
  while (SSL_read(ssl, rest, sizeof rest) > 0) {
  }
  double end = now_s();
  if (end - bodies > 10) return printf("error: 421 and the close came %.1f s after the bodies\n", end - bodies), 1;
  printf("ok pipelined: 2 x %llu bytes (length, chunked) in %.3f s, 404 to the Upgrade, 421 and close %.3f s later\n",
         down, bodies - start, end - bodies);
  return 0;
}

static SSL* connect_tls(SSL_CTX* ctx, const char* port, const char* sni, int* fd_out, SSL_SESSION* offer) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(port))};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, (struct sockaddr*)&a, sizeof a) != 0) return NULL;
  SSL* ssl = SSL_new(ctx);
  SSL_set_fd(ssl, fd);
  SSL_set_tlsext_host_name(ssl, sni);
  SSL_set1_host(ssl, sni);
  if (offer) SSL_set_session(ssl, offer);
  if (SSL_connect(ssl) != 1) return NULL;
  *fd_out = fd;
  return ssl;
}

/* One GET /len/DOWN on a new connection, answered 200 with the stream; the connection, or NULL. */
static SSL* get_on_new_connection(SSL_CTX* ctx, const char* port, const char* sni, const char* request, size_t len,
                                  unsigned long long down, char* head, size_t head_cap) {
  int fd = -1;
  head[0] = 0;
  SSL* ssl = connect_tls(ctx, port, sni, &fd, NULL);
  if (!ssl) return NULL;
  struct test_stream s;
  test_stream_init(&s, KTLS_DOWN_SEED);
  if (ssl_write_all(ssl, (const unsigned char*)request, len) != 0 || read_head(ssl, head, head_cap) != 0 ||
      strncmp(head, "HTTP/1.1 200", 12) != 0 || read_stream(ssl, &s, down) != 0) {
    SSL_free(ssl);
    close(fd);
    return NULL;
  }
  return ssl;
}

static int hold(SSL_CTX* ctx, const char* port, const char* sni, unsigned long long down, int count) {
  char request[256], head[4096];
  int len = snprintf(request, sizeof request, "GET /len/%llu HTTP/1.1\r\nHost: %s\r\n\r\n", down, sni);
  /* The client's own memory is not measured, but 10,000 connections (the soak) with idle read and write
   * buffers would take ~0.5 GiB of the guest. */
  SSL_CTX_set_mode(ctx, SSL_MODE_RELEASE_BUFFERS);
  double start = now_s();
  for (int i = 0; i < count; ++i) {
    /* The first is retried for 60 s: the sandbox may still be starting. */
    SSL* ssl = NULL;
    for (int attempt = 0; !ssl && attempt < (i == 0 ? 300 : 1); ++attempt) {
      if (attempt > 0) usleep(200 * 1000);
      ssl = get_on_new_connection(ctx, port, sni, request, (size_t)len, down, head, sizeof head);
    }
    if (!ssl) return printf("error: connection %d got no answer: %s\n", i, head), 1;
  }
  printf("ok held %d opened_in_s=%.1f\n", count, now_s() - start);
  fflush(stdout);
  for (;;) pause();
}

int main(int argc, char** argv) {
  if (argc < 8) {
    fprintf(stderr, "usage: %s PORT SNI CA_FILE 1.2|1.3 CIPHER UP DOWN [keyupdate|alert|empty|resume|pipeline OTHER_HOST|hold N]\n", argv[0]);
    return 2;
  }
  const char* sni = argv[2];
  int tls13 = strcmp(argv[4], "1.3") == 0;
  unsigned long long up = strtoull(argv[6], NULL, 10);
  unsigned long long down = strtoull(argv[7], NULL, 10);
  int keyupdate = argc > 8 && strcmp(argv[8], "keyupdate") == 0;
  int alert = argc > 8 && strcmp(argv[8], "alert") == 0;
  const char* pipeline_other = argc > 9 && strcmp(argv[8], "pipeline") == 0 ? argv[9] : NULL;
  int hold_count = argc > 9 && strcmp(argv[8], "hold") == 0 ? atoi(argv[9]) : 0;
  int resume = argc > 8 && strcmp(argv[8], "resume") == 0;
  int empty = argc > 8 && strcmp(argv[8], "empty") == 0;
  if (empty && (!tls13 || strcmp(argv[5], "TLS_AES_128_GCM_SHA256") != 0))
    return printf("error: empty needs TLS 1.3 and TLS_AES_128_GCM_SHA256\n"), 1;

  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  int version = tls13 ? TLS1_3_VERSION : TLS1_2_VERSION;
  SSL_CTX_set_min_proto_version(ctx, version);
  SSL_CTX_set_max_proto_version(ctx, version);
  if (!(tls13 ? SSL_CTX_set_ciphersuites(ctx, argv[5]) : SSL_CTX_set_cipher_list(ctx, argv[5])))
    return fail("cipher");
  if (SSL_CTX_load_verify_locations(ctx, argv[3], NULL) != 1) return fail("CA file");
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
  if (alert) SSL_CTX_set_options(ctx, SSL_OP_ENABLE_KTLS);
  if (empty) SSL_CTX_set_keylog_callback(ctx, keylog);
  if (hold_count > 0) return hold(ctx, argv[1], sni, down, hold_count);
  SSL_SESSION* offer = NULL;
  if (resume) {
    /* A first connection whose session the transfer's offers: by session ID, the server's cache (no ticket). */
    SSL_CTX_set_options(ctx, SSL_OP_NO_TICKET);
    int first_fd = -1;
    SSL* first = connect_tls(ctx, argv[1], sni, &first_fd, NULL);
    if (!first) return fail("first connection");
    offer = SSL_get1_session(first);
    SSL_shutdown(first);  /* a clean end keeps the session resumable on this side */
    SSL_free(first);
    close(first_fd);
  }

  double start = now_s();
  int fd = -1;
  SSL* ssl = connect_tls(ctx, argv[1], sni, &fd, offer);
  if (!ssl) return fail("connect or handshake");
  const char* negotiated = SSL_get_cipher_name(ssl);
  if (alert && !BIO_get_ktls_send(SSL_get_wbio(ssl))) return fail("the alert case needs the client's transmit in kTLS");
  if (pipeline_other) return pipeline(ssl, sni, pipeline_other, down);

  char head[256];
  int head_len = snprintf(head, sizeof head, "GET /?down=%llu HTTP/1.1\r\nHost: %s\r\n\r\n", down, sni);
  struct sealer own = {.fd = fd};
  if (empty) {
    if (!have_client_secret || expand_label(client_secret, "key", own.key, 16) != 0 ||
        expand_label(client_secret, "iv", own.iv, 12) != 0)
      return fail("the client's traffic key");
    if (seal_all(&own, (const unsigned char*)head, (size_t)head_len) != 0 || seal_record(&own, 23, NULL, 0) != 0)
      return fail("write head and an empty record");
  } else if (ssl_write_all(ssl, (const unsigned char*)head, (size_t)head_len) != 0) {
    return fail("write head");
  }

  static unsigned char buf[CHUNK], expect[CHUNK];
  struct test_stream s;
  test_stream_init(&s, KTLS_UP_SEED);
  EVP_MD_CTX* md = EVP_MD_CTX_new();
  EVP_DigestInit_ex(md, EVP_sha256(), NULL);
  unsigned long long left = up;
  int updated = 0;
  while (left > 0) {
    size_t n = left < CHUNK ? (size_t)left : CHUNK;
    test_stream_fill(&s, buf, n);
    EVP_DigestUpdate(md, buf, n);
    if (keyupdate && !updated && left <= up / 2) {
      if (SSL_key_update(ssl, SSL_KEY_UPDATE_NOT_REQUESTED) != 1) return fail("SSL_key_update");
      updated = 1;
    }
    if (alert && !updated && left <= up / 2) {
      if (send_alert_record(fd, 2 /* fatal */, 80 /* internal_error */) != 0) return fail("send alert");
      updated = 1;
      break;
    }
    if (empty && !updated && left <= up / 2) {
      if (seal_record(&own, 23, NULL, 0) != 0) return fail("write an empty record");
      updated = 1;
    }
    if (empty ? seal_all(&own, buf, n) != 0 : ssl_write_all(ssl, buf, n) != 0) {
      if (keyupdate && updated) break;
      return fail("write upload");
    }
    left -= n;
  }
  if (keyupdate || alert) {
    /* The proxy must end the connection: reading gives EOF or an error, never the answer. */
    int r = SSL_read(ssl, buf, sizeof buf);
    printf(r <= 0 ? "ok %s: connection closed by the proxy\n" : "error: the proxy answered after a %s\n",
           keyupdate ? "keyupdate" : "fatal alert");
    return r <= 0 ? 0 : 1;
  }
  unsigned char digest[32];
  EVP_DigestFinal_ex(md, digest, NULL);
  EVP_MD_CTX_free(md);
  /* Half-close: close_notify says "no more from me"; the answer still arrives. */
  static const unsigned char close_notify[2] = {1, 0};
  if (empty ? seal_record(&own, 21, close_notify, 2) != 0 : SSL_shutdown(ssl) < 0) return fail("close_notify");
  double uploaded = now_s();

  char line[128], want[128];
  int wl = 0;
  for (int i = 0; i < 32; ++i) wl += snprintf(want + wl, sizeof want - wl, "%02x", digest[i]);
  snprintf(want + wl, sizeof want - wl, " %llu\n", up);
  size_t ll = 0;
  while (ll < sizeof line - 1) {
    if (SSL_read(ssl, line + ll, 1) != 1) return fail("read answer line");
    if (line[ll++] == '\n') break;
  }
  line[ll] = 0;
  if (strcmp(line, want) != 0) {
    printf("error: upload mismatch: backend saw %s, client sent %s", line, want);
    return 1;
  }
  test_stream_init(&s, KTLS_DOWN_SEED);
  left = down;
  while (left > 0) {
    size_t n = left < CHUNK ? (size_t)left : CHUNK;
    test_stream_fill(&s, expect, n);
    if (ssl_read_full(ssl, buf, n) != n) return fail("download ended early");
    if (memcmp(buf, expect, n) != 0) {
      printf("error: download corrupted at byte %llu\n", down - left);
      return 1;
    }
    left -= n;
  }
  int r = SSL_read(ssl, buf, 1);
  if (r > 0 || SSL_get_error(ssl, r) != SSL_ERROR_ZERO_RETURN) {
    printf("error: expected close_notify after the download (SSL_read=%d, error=%d)\n", r, SSL_get_error(ssl, r));
    return 1;
  }
  double end = now_s();
  printf("ok %s %s up=%llu down=%llu upload_s=%.3f download_s=%.3f", SSL_get_version(ssl), negotiated, up, down,
         uploaded - start, end - uploaded);
  if (resume) printf(" resumed=%d", SSL_session_reused(ssl));
  printf("\n");
  SSL_free(ssl);
  close(fd);
  SSL_CTX_free(ctx);
  return 0;
}
