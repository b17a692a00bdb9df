#!/usr/bin/env bash
# The main job (as root): machine set-up, release build, then the rollout workload on its built-in
# defaults. Until `belayer rollout` exists, runs the checkpoint benchmark instead.
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

belayer="$CARGO_TARGET_DIR/release/belayer"
if "$belayer" rollout --help >/dev/null 2>&1; then
  exec "$belayer" rollout "$@"
fi
echo "[run] 'belayer rollout' is not available: running 'belayer bench checkpoint'" >&2
exec "$belayer" bench checkpoint
