#!/usr/bin/env bash
# The README's second command (and what .ci/run calls): install dependencies, build with warnings as
# errors, run the end-to-end tests (real daemons, real clients) against the plain build, then the whole suite
# (unit + end to end) under AddressSanitizer + UndefinedBehaviorSanitizer, with a short run of every fuzz
# target (tests/fuzz/run.sh) beside it. Needs root (namespaces, cgroups).
#   SANDGATE_SKIP_SANITIZE=1  only the plain tree, with every test (quicker local runs; no fuzz smoke)
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
# The code-interpreter flow's image (the test image plus pandas and matplotlib) is made after it, the same way.
{ tests/e2e/tools/make-test-image.sh "$SANDGATE_TEST_IMAGE_DIR" && tests/e2e/make-data-image.sh "$SANDGATE_TEST_IMAGE_DIR"; } \
  >build/test-image.log 2>&1 &
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
  local dir=$1
  shift
  phase "tests: $dir $*"
  # Unit tests run in parallel, end-to-end tests one at a time beside them (tests/CMakeLists.txt).
  ctest --test-dir "$dir" --output-on-failure -j "$jobs" --timeout 300 "$@" ${CTEST_ARGS:-}
}

sanitize=1
[[ ${SANDGATE_SKIP_SANITIZE:-0} == 1 ]] && sanitize=0

# Two trees. build: the daemons as shipped (RelWithDebInfo), which the end-to-end tests run. build-asan: clang
# with ASan + UBSan and libFuzzer's coverage hooks, which runs the whole suite again (unit tests included) and
# whose fuzz targets the smoke run uses. The unit tests run only there (they test the libraries, and a
# sanitized run of them is the stricter one), so the plain tree builds what the end-to-end tests need; with
# SANDGATE_SKIP_SANITIZE=1 the plain tree builds and runs everything.
# Line tables only (-g1): stack traces (the sanitizers', a core's) still name file and line, and compiling,
# most of what this script spends, takes less (a cold RelWithDebInfo build on 2 cores: 2,421 s of compile jobs
# with -g, 1,879 s with -g1; api_server_test.cc alone 30.9 s -> 17.7 s).
line_tables=(-DCMAKE_C_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG")
configure build -DCMAKE_BUILD_TYPE=RelWithDebInfo "${line_tables[@]}"
phase "build: build"
if ((sanitize)); then
  ninja -C build e2e_tests
else
  ninja -C build
fi
wait "$image_pid" || { cat build/test-image.log >&2; echo "tests/run.sh: the test image could not be made" >&2; exit 1; }
if ((!sanitize)); then
  run_tests build
  phase "tests/run.sh: all suites passed (no sanitizer pass, no fuzz smoke: SANDGATE_SKIP_SANITIZE=1)"
  exit 0
fi

# The sanitizer tree is built in the background at a lower priority while the first pass's tests run: they
# are end to end and serial, waiting on daemons and clients, and leave CPU that the compiler takes (it
# yields whenever a test wants it). clang, because it compiles this code at -O0 with the sanitizers in about
# two thirds of GCC's time and is the compiler libFuzzer needs. Its output goes to build/later-asan.log.
configure build-asan -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_C_FLAGS_DEBUG=-g1 -DCMAKE_CXX_FLAGS_DEBUG=-g1 -DSANDGATE_FUZZ=ON -DSANDGATE_BENCH=OFF
later=$PWD/build/later
rm -f "$later"-*
# A failing pass ends the script: what runs in the background (the compiler, then the fuzzers) goes with it.
stop_on_exit() { trap "pkill -P $1 2>/dev/null; kill $1 2>/dev/null || true" EXIT; }
nice -n 10 ninja -C build-asan >"$later-asan.log" 2>&1 &
asan_pid=$!
stop_on_exit "$asan_pid"

run_tests build -L e2e
phase "build (in the background since the first tests): build-asan"
if ! wait "$asan_pid"; then
  tail -n 60 "$later-asan.log" >&2
  echo "tests/run.sh: the build of build-asan failed (whole log: $later-asan.log)" >&2
  exit 1
fi

# Fuzz smoke: every libFuzzer target (tests/fuzz) for 15 s from its seeds, beside the sanitizer tests at a
# lower priority (time-bounded, so it only runs fewer inputs when the tests are busy); a crash fails the run
# and leaves its input in build-asan/fuzz/artifacts/.
phase "fuzz smoke: build-asan (in the background)"
nice -n 10 tests/fuzz/run.sh build-asan 15 >"$later-fuzz.log" 2>&1 &
fuzz_pid=$!
stop_on_exit "$fuzz_pid"
# Tests that run against the plain tree only: their time goes to tools outside our code (testssl, mmdebstrap,
# QEMU under TCG), and the code of ours they drive runs sanitized in the tests named beside each. Together
# about 5 min of the sanitizer pass, which the 45-minute CI budget needs (44.5 min with the first seven,
# 2026-12-05; 46.2 min with the disk checkpoint tests sanitized too, 2026-12-06).
plain_only=(
  TlsConfig.TestsslFindsNoWeakProtocolCipherOrVulnerability               # TLS settings both trees share
  ImageBuildDebian.PackagesAndRunOnAnMmdebstrapBase                       # ImageBuild.*
  Qemu.TheAgentServesTheSdkAndSshAlsoAfterWakingFromBothTiers             # AgentSsh.*, python_sdk_e2e
  Qemu.InternetAccessGoesThroughTheNodesEgressAndItsListsAndWithoutItNothing  # Egress.*
  Qemu.GuestIsSealedFromTheHostAndOtherVmsAndItsCommandIsNotInTheProcessList  # Boundary.*, QemuDriverTest
  Qemu.ImageDiskKeepsWhatTheGuestWroteAcrossSuspendHibernateAndNodeRestart    # Qemu.ImageDiskFromTheNode...
  Qemu.ANodeKilledDuringAHibernationOrARestoreKeepsTheGuestsMemory        # NodeKill.*, Qemu.WakesFromBothTiers...
  Qemu.ANodeKilledDuringADiskCheckpointLeavesNoSnapshotAndTheGuestGoesOn  # QemuDiskTest.*, Qemu.ANodeKilledDuringAMemory...
  Qemu.ALineOfSandboxesFromCheckpointsKeepsItsDiskChainShort              # DiskDeltaTest.*, Qemu.AFilesystemCheckpoint...
  Qemu.DiskFullDuringHibernateKeepsTheSandboxInMemory                     # QemuDriverTest (migrate-fail), NodeTest
  Qemu.DiskFullDuringAMemoryCheckpointLeavesNoSnapshotAndTheGuestRunning  # QemuDriverTest.AFailedMemoryCheckpoint...
)
plain_only_regex="^($(IFS='|'; echo "${plain_only[*]//./\\.}"))\$"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  run_tests build-asan -E "$plain_only_regex"
phase "fuzz smoke: waiting for it"
if ! wait "$fuzz_pid"; then
  cat "$later-fuzz.log" >&2
  exit 1
fi
trap - EXIT
cat "$later-fuzz.log"
phase "tests/run.sh: all suites passed"
