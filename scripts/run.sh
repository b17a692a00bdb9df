#!/usr/bin/env bash
# The main job (as root): machine set-up, release build, then the rollout workload on its built-in
# defaults (the daemon at $BELAYER_SOCKET when one answers, else a private `belayerd` child).
#
# Usage: scripts/run.sh [arguments for `belayer rollout`]
# Environment: CARGO_TARGET_DIR (default: the repository's target/), BELAYER_CACHE (see scripts/setup.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

setup_env=$(bash scripts/setup.sh)
eval "$setup_env"

export PATH="$HOME/.cargo/bin:$PATH"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
cargo build --release --bins

exec "$CARGO_TARGET_DIR/release/belayer" rollout "$@"
