#!/usr/bin/env bash
# The README's second command (and what .ci/run calls): install dependencies, build with warnings as
# errors, run every test (unit + end to end with real clients), then run the suite again under
# AddressSanitizer + UndefinedBehaviorSanitizer, then a short run of every fuzz target (tests/fuzz/run.sh).
# Needs root (namespaces, cgroups).
#   SANDGATE_SKIP_SANITIZE=1  skip the sanitizer pass (quicker local runs)
#   CTEST_ARGS="-R Slice"     pass a filter to ctest
set -euo pipefail
cd "$(dirname "$0")/.."

[[ $(id -u) -eq 0 ]] || { echo "tests/run.sh: run as root (sandboxes need namespaces and cgroups)" >&2; exit 1; }

deploy/install-deps.sh

# Every e2e sandbox runs on one test image (a Debian tree with the test servers, tests/e2e/tools/
# make-test-image.sh): made once here, cached under build/ by a key of its inputs, and shared with both
# passes (and its layer store with every test node) through this directory.
# Made while the first tree builds (it is mostly dpkg unpacking), waited for before the tests.
export SANDGATE_TEST_IMAGE_DIR=$PWD/build/test-image
mkdir -p build
tests/e2e/tools/make-test-image.sh "$SANDGATE_TEST_IMAGE_DIR" >build/test-image.log 2>&1 &
image_pid=$!

jobs=$(nproc)
# Each phase is stamped, so a run's log says where its time went.
phase() { echo "=== $(date +%T) $*"; }
configure() {
  local dir=$1
  shift
  phase "configure: $dir ($*)"
  cmake -S . -B "$dir" -G Ninja -DSANDGATE_WERROR=ON "$@" >/dev/null
}
run_tests() {
  phase "tests: $1"
  # Unit tests run in parallel; end-to-end tests are RUN_SERIAL (they share cgroup trees and CPU).
  ctest --test-dir "$1" --output-on-failure -j "$jobs" --timeout 300 ${CTEST_ARGS:-}
}

# Line tables only (-g1): stack traces (the sanitizers', a core's) still name file and line, and compiling,
# most of what this script spends, takes less (a cold RelWithDebInfo build on 2 cores: 2,421 s of compile jobs
# with -g, 1,879 s with -g1; api_server_test.cc alone 30.9 s -> 17.7 s).
line_tables=(-DCMAKE_C_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG")
configure build -DCMAKE_BUILD_TYPE=RelWithDebInfo "${line_tables[@]}"
phase "build: build"
ninja -C build
wait "$image_pid" || { cat build/test-image.log >&2; echo "tests/run.sh: the test image could not be made" >&2; exit 1; }

# The sanitizer and fuzz trees are built in the background at a lower priority, one after the other: the
# sanitizer tree while the first pass's tests run, the fuzz tree while the sanitizer pass's tests run. Most of
# those tests are end to end and serial, waiting on daemons and clients, and leave a core idle that the
# compiler takes (it yields the CPU whenever a test wants it). Their output goes to build/later-*.log, shown
# on failure.
sanitize=1
[[ ${SANDGATE_SKIP_SANITIZE:-0} == 1 ]] && sanitize=0
if ((sanitize)); then
  configure build-asan -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS_DEBUG=-g1 -DCMAKE_CXX_FLAGS_DEBUG=-g1 \
    -DSANDGATE_SANITIZE=ON -DSANDGATE_BENCH=OFF
fi
# Fuzz smoke: every libFuzzer target (tests/fuzz) for 15 s from its seeds; a crash fails the run and leaves its
# input in build-fuzz/fuzz/artifacts/. Only the targets and the libraries they link are built (clang).
configure build-fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DSANDGATE_FUZZ=ON \
  -DSANDGATE_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo "${line_tables[@]}"
later=$PWD/build/later
rm -f "$later"-*
(
  rc=0
  if ((sanitize)); then
    nice -n 10 ninja -C build-asan >"$later-asan.log" 2>&1 || rc=$?
  fi
  echo "$rc" >"$later-asan.rc"
  nice -n 10 ninja -C build-fuzz fuzz_targets >"$later-fuzz.log" 2>&1
) &
later_pid=$!
# A failing pass ends the script: the compilers go with it.
trap 'pkill -P "$later_pid" 2>/dev/null; kill "$later_pid" 2>/dev/null || true' EXIT
build_failed() {
  tail -n 60 "$later-$1.log" >&2
  echo "tests/run.sh: the build of build-$1 failed (whole log: $later-$1.log)" >&2
  exit 1
}

run_tests build
phase "build (in the background since the first tests): build-asan"
# The rc file appears when the sanitizer build ends (a child's child: no wait for it).
while [[ ! -s $later-asan.rc ]] && kill -0 "$later_pid" 2>/dev/null; do sleep 1; done
[[ $(cat "$later-asan.rc" 2>/dev/null) == 0 ]] || build_failed asan
if ((sanitize)); then
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 run_tests build-asan
fi
phase "build (in the background since the sanitizer tests): build-fuzz"
wait "$later_pid" || build_failed fuzz
trap - EXIT
phase "fuzz smoke: build-fuzz"
tests/fuzz/run.sh build-fuzz 15
phase "tests/run.sh: all suites passed"
