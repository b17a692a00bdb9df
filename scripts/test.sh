#!/usr/bin/env bash
# The test command (as root): machine set-up, then format check, lints, build and the whole test
# suite against the real kernel and CRIU. Exits non-zero on the first failure.
#
# Usage: scripts/test.sh [extra arguments for `cargo test --workspace`, e.g. -- --test-threads=1]
# Environment: CARGO_TARGET_DIR (default: the repository's target/), CI=true (no colours),
#              BELAYER_CACHE (see scripts/setup.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# setup.sh prints `export NAME=value` lines: the test image paths (BELAYER_TEST_BUSYBOX_ROOTFS,
# BELAYER_TEST_PYTHON_ROOTFS) and the CRIU binary.
setup_env=$(bash scripts/setup.sh)
eval "$setup_env"

export PATH="$HOME/.cargo/bin:$PATH"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
export RUST_BACKTRACE=1
if [ "${CI:-}" = true ]; then
  export CARGO_TERM_COLOR=never NO_COLOR=1
fi

step() {
  local start=$SECONDS
  printf '[test] %s\n' "$*" >&2
  "$@"
  printf '[test] ok in %d s: %s\n' "$((SECONDS - start))" "$*" >&2
}

# Installs the Python package (pure ctypes) from python/ and runs its pytest suite against a
# daemon started from the built belayerd; the package finds the built libbelayer.so through
# CARGO_TARGET_DIR; test_minisweagent.py drives the pinned mini-swe-agent that setup.sh installs.
# pytest's exit 5 (no tests collected) fails the run like any other failure.
python_tests() {
  local pip_args=(--quiet --force-reinstall --no-deps)
  python3 -c 'import setuptools, wheel' 2>/dev/null && pip_args+=(--no-build-isolation)
  python3 -m pip install "${pip_args[@]}" ./python
  (cd python/tests && python3 -m pytest -q -p no:cacheprovider --ignore-glob='test_harbor_*' .)
}

# The Harbor environment (belayer.integrations.harbor) under Harbor's own runner, in the venv
# that setup.sh made with the pinned harbor (Python >= 3.12).
python_harbor_tests() {
  local py="$BELAYER_HARBOR_VENV/bin/python"
  "$py" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps ./python
  (cd python/tests && "$py" -m pytest -q -p no:cacheprovider test_harbor_*.py)
}

# The `belayer` client is built without belayer-ipc's `cuda` feature: cudarc is not among its
# dependencies.
client_links_no_cuda() {
  # grep reads the whole tree (no -q: an early exit would make pipefail hide a match).
  if cargo tree -p belayer-cli -e normal | grep cudarc >&2; then
    echo "belayer-cli depends on cudarc; only the crates that map GPU memory enable belayer-ipc/cuda" >&2
    return 1
  fi
}

step cargo fmt --all -- --check
step cargo clippy --workspace --all-targets -- -D warnings
step cargo build --workspace --bins
# libbelayer.so/.a (the C ABI); its tests also regenerate include/belayer.h with cbindgen and fail
# when the checked-in header differs (tests/header.rs).
step cargo build -p belayer-capi
step cargo test --workspace --no-fail-fast "$@"
# Built alone, belayer-ipc has no CUDA backend (its cargo feature `cuda`, which the workspace build
# turns on through belayer-workers): lint and test that build too, and keep the client off cudarc.
step cargo clippy -p belayer-ipc --all-targets -- -D warnings
step cargo test -p belayer-ipc --lib
step client_links_no_cuda
step python_tests
step python_harbor_tests
