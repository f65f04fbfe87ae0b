#!/usr/bin/env python3
"""The full testssl.sh scan (Debian's `testssl.sh`: every protocol, cipher, header and vulnerability check,
about 5 minutes) of a sandgate-proxy on loopback with a fresh wildcard certificate from a local CA (trusted
with --add-ca). Prints testssl's report and, last, every finding above INFO as `severity id finding`; exit 1
if one is neither expected for a local CA (no CRL/OCSP, no CAA record) nor OK. CI runs a shorter subset
(tests/e2e/tls_config_test.cc).

  bench/testssl.py [BUILD_DIR]     (default: build; run as root)"""
import json
import os
import subprocess
import sys

import sgbench

EXPECTED_FOR_A_LOCAL_CA = {"cert_revocation", "DNS_CAArecord"}


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else os.path.join(sgbench.ROOT, "build")
    c = sgbench.Cluster(build, "testssl")
    try:
        out = c.tmp + "/testssl.json"
        subprocess.run(["testssl", "--quiet", "--color", "0", "--warnings", "off", "--ip", "127.0.0.1",
                        "--add-ca", c.ca, "--jsonfile", out, f"api.{sgbench.DOMAIN}:{c.port}"],
                       env=dict(os.environ, HOME=c.tmp))  # its exit status counts findings of any kind
        findings = [f for f in json.load(open(out)) if f["severity"] not in ("OK", "INFO")]
        unexpected = [f for f in findings if f["id"] not in EXPECTED_FOR_A_LOCAL_CA]
        print("\nfindings above INFO:")
        for f in findings:
            note = "" if f in unexpected else "  (expected: local CA)"
            print(f"  {f['severity']} {f['id']}: {f['finding']}{note}")
        return 1 if unexpected else 0
    finally:
        c.close()


if __name__ == "__main__":
    sys.exit(main())
