#!/usr/bin/env bash
# Configures and builds sandgate with CMake + Ninja.
#   deploy/build.sh [extra cmake args...]     e.g. deploy/build.sh -DSANDGATE_BENCH=OFF
# Environment: BUILD_DIR (default <repo>/build), CMAKE_BUILD_TYPE (default RelWithDebInfo),
# CI=true adds -DSANDGATE_WERROR=ON, BUILD_TARGETS="t1 t2" builds only those targets (the quickstart: the
# daemons, the CLI, init and the agent, not the ~100 test and benchmark targets). Extra arguments come last,
# so they override these defaults.
set -euo pipefail

ROOT=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd) # through symlinks, too
BUILD_DIR=${BUILD_DIR:-$ROOT/build}

for tool in cmake ninja; do
  if ! command -v "$tool" >/dev/null; then
    echo "build: $tool not found; run deploy/install-deps.sh first" >&2
    exit 1
  fi
done

args=(-S "$ROOT" -B "$BUILD_DIR" -G Ninja "-DCMAKE_BUILD_TYPE=${CMAKE_BUILD_TYPE:-RelWithDebInfo}")
if [[ ${CI:-} == true ]]; then
  args+=(-DSANDGATE_WERROR=ON)
fi

echo "build: configuring $BUILD_DIR" >&2
cmake "${args[@]}" "$@"
if [[ -n ${BUILD_TARGETS:-} ]]; then
  read -r -a targets <<<"$BUILD_TARGETS"
  echo "build: building ${targets[*]}" >&2
  cmake --build "$BUILD_DIR" --target "${targets[@]}"
else
  echo "build: building" >&2
  cmake --build "$BUILD_DIR"
fi
echo "build: done; binaries in $BUILD_DIR/{noderuntime,proxy,cli}" >&2
