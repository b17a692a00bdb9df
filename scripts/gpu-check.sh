#!/usr/bin/env bash
# GPU check of the memory servers' CUDA backend (needs an NVIDIA GPU and driver; run as root).
#
# Runs, against CUDA device $BELAYER_GPU_DEVICE (default cuda:0):
#   1. the ipc memory unit tests (a real device: export, import, map, unmap/remap, memset,
#      health check; CUDA placeholders and the C ABI);
#   2. the multi-process memory tests with BELAYER_TEST_DEVICE set: a `belayer-memd`
#      child owns the memory, helper processes attach, are SIGKILLed, a second process imports
#      and reads identical bytes, the KV arena is flushed, unmap/remap keep the address, leases,
#      owner-alive detection;
#   3. `belayer-bench memory` on the GPU: a 16 GiB weights layout (1 and 64 regions) plus an
#      8 GiB KV arena: server start (cuMemCreate + export + zero), attach in a second process
#      (fd receipt + cuMemImportFromShareableHandle + cuMemMap + cuMemSetAccess), pattern check,
#      unmap, remap, KV flush; and the host backend for comparison.
#
# Usage:
#   scripts/gpu-check.sh                 build with cargo (release) and run everything
#   scripts/gpu-check.sh --prepare DIR   only build, and copy stripped binaries into DIR (on a
#                                        machine without a GPU, to carry DIR to one without cargo)
#   BELAYER_PREBUILT=DIR scripts/gpu-check.sh   run with the binaries of --prepare
# Environment: BELAYER_GPU_DEVICE (cuda:N), OUT (where the log goes; default target/gpu-check),
#              CARGO_TARGET_DIR (default target/).
# Exit status: 0 when every step passed, 1 when one failed, 2 when there is no GPU/driver.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

device=${BELAYER_GPU_DEVICE:-cuda:0}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}

# Builds the release binaries and prints "bench-dir ipc-test workers-lib-test memory-test"
# paths (bench-dir holds belayer-bench and belayer-memd).
build() {
  export PATH="$HOME/.cargo/bin:$PATH"
  cargo build --release -p belayer-workers -p belayer-bench --bins >&2
  local ipc agent_lib memory
  exe_of() { sed -n 's/^ *Executable .*(\(.*\))$/\1/p' | head -1; }
  ipc=$(cargo test --release -p belayer-ipc --features cuda --lib --no-run 2>&1 | tee /dev/stderr | exe_of)
  agent_lib=$(cargo test --release -p belayer-workers --lib --no-run 2>&1 | tee /dev/stderr | exe_of)
  memory=$(cargo test --release -p belayer-workers --test memory --no-run 2>&1 | tee /dev/stderr | exe_of)
  if [ -z "$ipc" ] || [ -z "$agent_lib" ] || [ -z "$memory" ]; then
    echo "gpu-check: could not find the test binaries in cargo's output" >&2
    exit 1
  fi
  echo "$CARGO_TARGET_DIR/release $ipc $agent_lib $memory"
}

if [ "${1:-}" = --prepare ]; then
  dir=${2:?usage: scripts/gpu-check.sh --prepare DIR}
  read -r bins ipc agent_lib memory < <(build) || true
  [ -n "${memory:-}" ] || { echo "gpu-check: build failed" >&2; exit 1; }
  mkdir -p "$dir"
  strip -o "$dir/belayer-bench" "$bins/belayer-bench"
  strip -o "$dir/belayer-memd" "$bins/belayer-memd"
  strip -o "$dir/ipc-test" "$ipc"
  strip -o "$dir/agent-lib-test" "$agent_lib"
  strip -o "$dir/memory-test" "$memory"
  du -sh "$dir"
  exit 0
fi

out=${OUT:-$CARGO_TARGET_DIR/gpu-check}
mkdir -p "$out"
log="$out/gpu-check.log"
: >"$log"
say() { printf '%s\n' "$*" | tee -a "$log"; }

say "== gpu-check $(date -u +%FT%TZ) device=$device"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi >>"$log" 2>&1; then
  say "gpu-check: no NVIDIA GPU or driver here (nvidia-smi failed); nothing to check"
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv | tee -a "$log"
if ! ldconfig -p | grep -q 'libcuda\.so'; then
  say "gpu-check: libcuda.so is not in the loader cache; the driver library must be loadable"
  exit 2
fi

if [ -n "${BELAYER_PREBUILT:-}" ]; then
  bins=$BELAYER_PREBUILT
  ipc=$BELAYER_PREBUILT/ipc-test
  agent_lib=$BELAYER_PREBUILT/agent-lib-test
  memory=$BELAYER_PREBUILT/memory-test
else
  read -r bins ipc agent_lib memory < <(build 2>>"$log") || true
fi
bench=${bins:-}/belayer-bench
if [ -z "${memory:-}" ] || [ ! -x "$bench" ]; then
  say "gpu-check: building the binaries failed (see $log)"
  exit 1
fi
say "binaries: $bench $ipc $agent_lib $memory"

failed=0
step() {
  local name=$1
  shift
  local start=$SECONDS
  say "== $name"
  if "$@" 2>&1 | tee -a "$log"; then
    say "== ok ($((SECONDS - start)) s): $name"
  else
    say "== FAILED ($((SECONDS - start)) s): $name"
    failed=1
  fi
}

export RUST_BACKTRACE=1
# The tests print why they skip; with a driver present, none of the CUDA ones may skip.
step "ipc memory tests (CUDA device tests included)" \
  "$ipc" memory:: --test-threads=1 --nocapture
step "workers memory unit tests" \
  "$agent_lib" memory:: --test-threads=1
step "multi-process memory tests on $device" \
  env BELAYER_TEST_DEVICE="$device" BELAYER_MEMD="$bins/belayer-memd" "$memory" --test-threads=1
step "bench: 1 GiB and 16 GiB weights (1 region) + 8 GiB KV arena on $device" \
  "$bench" memory --device "$device" --sizes 1G,16G --kv 8G --runs 20
step "bench: 16 GiB weights in 64 regions on $device" \
  "$bench" memory --device "$device" --sizes 16G --regions 64 --runs 20
step "bench: host backend, 1, 8, 64 GiB (for comparison)" \
  "$bench" memory --device host --sizes 1G,8G,64G --kv 8G --runs 20

# Skips that mean "no usable GPU" (the no-driver tests legitimately skip when a driver exists).
if grep -qE 'skipping: (no CUDA driver|CUDA device [0-9]+ unavailable)|but no CUDA driver is present' "$log"; then
  say "gpu-check: some CUDA tests skipped although a GPU is present (see 'skipping:' above)"
  failed=1
fi
say "== gpu-check $([ $failed = 0 ] && echo passed || echo FAILED); log: $log"
exit $failed
