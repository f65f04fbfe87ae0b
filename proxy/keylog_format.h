// OpenSSL 3.0 hands a keylog callback each TLS 1.3 secret as a line of hex that it formats with one
// sprintf("%02x") per byte (ssl/ssl_lib.c, nss_keylog_int): five lines, about 350 calls to glibc's
// __sprintf_chk per handshake, 25-30 µs of CPU, a twentieth of a new connection (bench/RESULTS.md). The
// proxy needs two of those secrets (kTLS receive, its own record layer: proxy/ktls.h) and OpenSSL 3.0 has
// no other way to give them out.
//
// keylog_format.cc therefore defines __sprintf_chk in the executable that links it; the dynamic linker
// binds libssl's calls to it ahead of glibc's. The exact format "%02x" with a value below 256 is written
// directly; every other call goes on to glibc's __vsprintf_chk unchanged, so output and buffer checks stay
// glibc's. Anything else in the process calling sprintf with fortification gets the same.
#pragma once

namespace sg {

// Whether this process's __sprintf_chk is the one above (not when a preload or a static libc binds it
// elsewhere; then the keylog formatting costs what it costs in OpenSSL).
bool keylog_hex_fast_path_in_use();

}  // namespace sg
