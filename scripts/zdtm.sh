#!/usr/bin/env bash
# CRIU conformance run: CRIU's own zdtm static tests, each started in a Belayer sandbox of the
# python image, checkpointed, SIGKILLed from the host, restored and stopped with SIGTERM; the
# test's own PASS/FAIL is the verdict (see scripts/zdtm.py for the steps and the classes).
#
# This wrapper (as root):
#   1. builds zdtm's lib and static tests from the CRIU source tree ($BELAYER_CRIU_SRC, default
#      /var/cache/belayer/criu-4.2.1, never written to) in a cache dir (default
#      /var/cache/belayer/zdtm-build): test/zdtm and criu/include (which static/Makefile's
#      criu-rtc.so rule includes) are copied there once, then `make -j2 -k` (idempotent: make
#      rebuilds only what is missing; tests that cannot build here are reported, not fatal);
#      `--zdtm-dir DIR` uses an already built test/zdtm instead and skips the build;
#   2. makes the image dir (default /var/cache/belayer/zdtm-image/rootfs): a copy of the python
#      image rootfs (made once; the original is never modified) plus the built static tests
#      under /zdtm/static and the lib under /zdtm/lib (refreshed when the build is newer);
#   3. runs scripts/zdtm.py, which starts its own belayerd and runs the tests.
#
# Usage: scripts/zdtm.sh [--zdtm-dir DIR] [--build-dir DIR] [--image-dir DIR] [--no-build]
#                        [zdtm.py options: --only A,B --pattern RE --jobs N --json FILE --control
#                         --timeout S --belayerd PATH ...]
# Environment: BELAYER_CRIU (default /usr/local/sbin/criu), BELAYER_CRIU_SRC,
#              BELAYER_PYTHON_ROOTFS (default /var/cache/belayer/images/bookworm-python/rootfs),
#              CARGO_TARGET_DIR (where the Python package finds libbelayer.so; default: the
#              repository's target/ when it holds one, else /work/main/target).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

criu_src=${BELAYER_CRIU_SRC:-/var/cache/belayer/criu-4.2.1}
python_rootfs=${BELAYER_PYTHON_ROOTFS:-/var/cache/belayer/images/bookworm-python/rootfs}
build_dir=/var/cache/belayer/zdtm-build
image_dir=/var/cache/belayer/zdtm-image/rootfs
zdtm_dir=
no_build=0
pass=()
while [ $# -gt 0 ]; do
  case $1 in
    --zdtm-dir) zdtm_dir=$2; shift 2 ;;
    --build-dir) build_dir=$2; shift 2 ;;
    --image-dir) image_dir=$2; shift 2 ;;
    --no-build) no_build=1; shift ;;
    -h|--help) sed -n '2,24p' "${BASH_SOURCE[0]}"; python3 "$repo/scripts/zdtm.py" --help; exit 0 ;;
    *) pass+=("$1"); shift ;;
  esac
done

log() { printf '[zdtm] %s\n' "$*" >&2; }
die() { printf '[zdtm] error: %s\n' "$*" >&2; exit 2; }

[ "$(id -u)" = 0 ] || die "run as root (belayerd needs it)"
export BELAYER_CRIU=${BELAYER_CRIU:-/usr/local/sbin/criu}
[ -x "$BELAYER_CRIU" ] || die "no criu at $BELAYER_CRIU"
[ -d "$python_rootfs/usr" ] || die "no python image rootfs at $python_rootfs"

# 1. The build.
if [ -z "$zdtm_dir" ]; then
  zdtm_dir=$build_dir/test/zdtm
  if [ ! -e "$build_dir/.copied" ]; then
    [ -d "$criu_src/test/zdtm/static" ] || die "no CRIU source tree at $criu_src"
    log "copying $criu_src/test/zdtm and criu/include into $build_dir"
    mkdir -p "$build_dir/test" "$build_dir/criu"
    rm -rf "$build_dir/test/zdtm" "$build_dir/criu/include"
    cp -a "$criu_src/test/zdtm" "$build_dir/test/zdtm"
    cp -a "$criu_src/criu/include" "$build_dir/criu/include"
    touch "$build_dir/.copied"
  fi
  if [ "$no_build" = 0 ]; then
    log "building zdtm lib and static tests in $zdtm_dir (make -j2 -k; log: $build_dir/make.log)"
    start=$SECONDS
    # -k: a test that cannot build here (missing libbpf, libaio, ...) leaves only its binary out.
    if ! make -j2 -k -C "$zdtm_dir/lib" >"$build_dir/make.log" 2>&1; then
      tail -n 20 "$build_dir/make.log" >&2
      die "the zdtm lib did not build (see $build_dir/make.log)"
    fi
    make -j2 -k -C "$zdtm_dir/static" all >>"$build_dir/make.log" 2>&1 ||
      log "some static tests did not build (see $build_dir/make.log); they are reported as not built"
    log "build done in $((SECONDS - start)) s"
  fi
fi
[ -f "$zdtm_dir/lib/libzdtmtst.a" ] || die "$zdtm_dir/lib/libzdtmtst.a missing: zdtm is not built"
[ -f "$zdtm_dir/static/Makefile" ] || die "no $zdtm_dir/static/Makefile"

# 2. The image dir: the python rootfs (copied once) plus /zdtm/{static,lib}.
if [ ! -e "$image_dir/.zdtm-base" ]; then
  log "copying the python image $python_rootfs to $image_dir"
  tmp="$image_dir.tmp.$$"
  rm -rf "$tmp"
  mkdir -p "$(dirname "$image_dir")"
  cp -a --reflink=auto "$python_rootfs" "$tmp"
  touch "$tmp/.zdtm-base"
  rm -rf "$image_dir"
  mv "$tmp" "$image_dir"
fi
stamp="$image_dir/zdtm/.source"
if [ ! -e "$stamp" ] || [ "$(cat "$stamp")" != "$zdtm_dir" ] ||
   [ -n "$(find "$zdtm_dir/static" "$zdtm_dir/lib" -newer "$stamp" -print -quit)" ]; then
  log "copying the built tests into $image_dir/zdtm"
  rm -rf "$image_dir/zdtm"
  mkdir -p "$image_dir/zdtm/static" "$image_dir/zdtm/lib"
  for d in static lib; do
    tar -C "$zdtm_dir/$d" -cf - --exclude='*.o' --exclude='*.d' \
      --exclude='*.pid' --exclude='*.out' --exclude='*.out.*' --exclude='*.test' . |
      tar -C "$image_dir/zdtm/$d" -xf -
  done
  # Tests without the `suid` flag drop to uid 18943 (as test/zdtm.py runs them) and must
  # still write their .pid and .out files there.
  chmod 0777 "$image_dir/zdtm/static"
  printf '%s' "$zdtm_dir" >"$stamp"
fi

# 3. The run.
if [ -z "${CARGO_TARGET_DIR:-}" ] && [ -z "${BELAYER_LIB:-}" ]; then
  if [ -e "$repo/target/release/libbelayer.so" ] || [ -e "$repo/target/debug/libbelayer.so" ]; then
    export CARGO_TARGET_DIR=$repo/target
  else
    export CARGO_TARGET_DIR=/work/main/target
  fi
fi
if ! python3 -c 'import belayer' 2>/dev/null; then
  log "installing the belayer Python package from $repo/python"
  python3 -m pip install --quiet --no-deps --force-reinstall "$repo/python"
fi
exec python3 "$repo/scripts/zdtm.py" --zdtm-dir "$zdtm_dir" --image-dir "$image_dir" "${pass[@]}"
