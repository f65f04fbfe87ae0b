#!/usr/bin/env python3
"""Sends raw bytes over one TLS connection and prints everything that comes back until the server closes.

  tls_pipeline.py ADDR PORT SNI CA_FILE REQUEST_FILE

For HTTP/1.1 keep-alive and pipelining tests: REQUEST_FILE holds several requests back to back, all sent at
once, as a pipelining client does. Exits 1 if the server does not close within 20 s.
"""
import socket
import ssl
import sys


def main():
    addr, port, sni, ca, request_file = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    ctx = ssl.create_default_context(cafile=ca)
    ctx.set_alpn_protocols(["http/1.1"])
    with socket.create_connection((addr, port), timeout=20) as raw:
        with ctx.wrap_socket(raw, server_hostname=sni) as tls:
            tls.sendall(open(request_file, "rb").read())
            out = bytearray()
            try:
                while True:
                    data = tls.recv(65536)
                    if not data:
                        break
                    out += data
            except (socket.timeout, TimeoutError):
                sys.stdout.buffer.write(bytes(out))
                print("\n[timeout: the server did not close]")
                return 1
            except (ssl.SSLError, ConnectionResetError) as e:
                out += ("\n[%s]" % e).encode()
            sys.stdout.buffer.write(bytes(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
