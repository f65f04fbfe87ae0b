#!/usr/bin/env bash
# Runs every libFuzzer target of a -DSANDGATE_FUZZ=ON build for SECONDS each (default 20: the CI smoke run;
# docs/tests.md describes long runs, e.g. `tests/fuzz/run.sh build-fuzz 600`), one after another, starting
# from the checked-in seeds. Exits non-zero as soon as a target finds a crash, leak, timeout or sanitizer
# report; the input that caused it is written to BUILD_DIR/fuzz/artifacts/<target>/.
# Everything written stays under BUILD_DIR/fuzz: the growing corpus (BUILD_DIR/fuzz/corpus/<target>, kept
# between runs so later runs start where earlier ones stopped), artifacts, logs and TMPDIR; the seeds in
# tests/fuzz/corpus are only read.
#   FUZZ_TARGETS="route http1"  run only these targets
#   FUZZ_RUNS=10000000          stop each target after this many executions (SECONDS stays the time cap): the
#                               documented long run, `FUZZ_RUNS=10000000 tests/fuzz/run.sh build-fuzz 7200`
set -euo pipefail

[[ $# -ge 1 && $# -le 2 ]] || { echo "usage: tests/fuzz/run.sh BUILD_DIR [SECONDS]" >&2; exit 2; }
build=$(cd "$1" && pwd)
seconds=${2:-20}
seeds=$(cd "$(dirname "$0")" && pwd)/corpus
read -ra targets <<<"${FUZZ_TARGETS:-client_hello route http1 h2_headers tls13_records api_body config}"
run_limit=()
if [[ -n ${FUZZ_RUNS:-} ]]; then
  [[ $FUZZ_RUNS =~ ^[1-9][0-9]*$ ]] || { echo "FUZZ_RUNS must be a positive integer" >&2; exit 2; }
  run_limit=(-runs="$FUZZ_RUNS")
fi

out=$build/fuzz
mkdir -p "$out/tmp"
export TMPDIR=$out/tmp
# UBSan findings abort like ASan's, so the fuzzer records them as crashes instead of printing and going on.
export UBSAN_OPTIONS=halt_on_error=1:abort_on_error=1:print_stacktrace=1

for t in "${targets[@]}"; do
  bin=$build/tests/fuzz/${t}_fuzz
  [[ -x $bin ]] || { echo "fuzz: $bin missing (configure with -DSANDGATE_FUZZ=ON and run ninja fuzz_targets)" >&2; exit 1; }
  mkdir -p "$out/corpus/$t" "$out/artifacts/$t"
  log=$out/$t.log
  start=$SECONDS
  # New inputs go to the first corpus directory (ours), never to the seed directory. -timeout: an input that
  # takes over 10 s is a hang, i.e. a finding.
  if ! "$bin" -max_total_time="$seconds" "${run_limit[@]}" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      -artifact_prefix="$out/artifacts/$t/" "$out/corpus/$t" "$seeds/$t" >"$log" 2>&1; then
    tail -n 60 "$log" >&2
    echo "fuzz: $t FAILED after $((SECONDS - start)) s; reproducer in $out/artifacts/$t/, log $log" >&2
    exit 1
  fi
  runs=$(awk '/stat::number_of_executed_units/ {print $2}' "$log")
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1)
  echo "fuzz: $t ok: $runs executions in $((SECONDS - start)) s ($((runs / (SECONDS - start > 0 ? SECONDS - start : 1))) exec/s), $cov"
done
