#!/usr/bin/env bash
# The Python SDK's suite as ctest runs it (tests/CMakeLists.txt):
#   run-tests.sh unit          the unit tests, against the source tree (no daemons)
#   run-tests.sh e2e BUILD_DIR `pip install` of sdk/python into a fresh venv (Debian's pip and setuptools, no
#                              index, no download), then every test against that install and real daemons
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
sdk=$(dirname "$here")
python=/usr/bin/python3
# No __pycache__ next to the sources: tests write only in their own temp dirs.
export PYTHONDONTWRITEBYTECODE=1
case ${1:-} in
  unit)
    cd "$here"
    PYTHONPATH=$sdk exec "$python" -m unittest -v test_http test_errors test_config test_protocol test_transport
    ;;
  e2e)
    build=$(cd "${2:?usage: run-tests.sh e2e BUILD_DIR}" && pwd)
    work=$(mktemp -d "${TMPDIR:-/tmp}/sandgate-sdk-venv.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    # A venv because Debian's own Python is externally managed (PEP 668); --system-site-packages so Debian's
    # pip and setuptools build and install the package (--no-build-isolation), and nothing is fetched. From a
    # copy, because a setuptools build writes build/ and *.egg-info next to the sources.
    cp -r "$sdk" "$work/src"
    rm -rf "$work/src/build" "$work/src"/*.egg-info
    "$python" -m venv --without-pip --system-site-packages "$work/venv"
    "$work/venv/bin/python" -m pip install --quiet --no-build-isolation --no-index --no-cache-dir "$work/src" \
      >"$work/pip.log" 2>&1 || { cat "$work/pip.log"; exit 1; }
    # The tests import the installed package, not the source tree: run from the tests directory only.
    cd "$here"
    "$work/venv/bin/python" -c 'import sandgate, sys; sys.exit(0 if "/venv/" in sandgate.__file__ else "not the installed package: " + sandgate.__file__)'
    SANDGATE_BUILD_DIR=$build "$work/venv/bin/python" -m unittest -v \
      test_http test_errors test_config test_protocol test_transport test_e2e test_qemu
    ;;
  *)
    echo "usage: run-tests.sh unit | e2e BUILD_DIR" >&2
    exit 2
    ;;
esac
