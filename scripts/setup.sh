#!/usr/bin/env bash
# Idempotent set-up of a fresh Debian 12 machine for Belayer: packages, CRIU 4.x from source, the
# Rust toolchain, kernel feature checks, the two test images and the btrfs state file system at
# /var/lib/belayer (disk quotas per sandbox). Safe to run again: every step is skipped when
# already done (a second run takes a few seconds at most).
#
# Usage: scripts/setup.sh            run everything (as root)
#        source scripts/setup.sh     define the functions and paths below, run nothing
#
# Environment:
#   BELAYER_CACHE          cache directory (default /var/cache/belayer)
#   BELAYER_DEBIAN_MIRROR  Debian mirror for debootstrap (default: the machine's apt configuration)
#   BELAYER_STATE_IMAGE_SIZE        size of a new state image (truncate syntax, e.g. 64G; default:
#                                   half the free space of $BELAYER_CACHE, at most 256G)
#   BELAYER_STATE_IMAGE_PREALLOCATE 1: reserve the image's blocks (fallocate) instead of sparse
#
# Logs go to stderr; the last lines on stdout are `export NAME=value` lines for the image paths
# and the test state root.
set -euo pipefail

CACHE=${BELAYER_CACHE:-/var/cache/belayer}
# CRIU 4.2.1: 4.1.1 cannot dump any TCP/UDP socket on kernels >= 6.16, where getsockopt of
# SO_PASSCRED/SO_PASSSEC on non-Unix sockets fails with EOPNOTSUPP ("sockets: Can't get 1:34
# opt"); 4.2 only reads those options on Unix and netlink sockets. Debian ships 4.2.1 in sid.
CRIU_VERSION=4.2.1
CRIU_SUITE=sid
CRIU_BIN=/usr/local/sbin/criu
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Fixes to CRIU's source applied before the build; each patch says what it changes and why.
CRIU_PATCHES="$REPO_ROOT/scripts/criu-patches"
IMAGES="$CACHE/images"
# Bump a *_RECIPE when the matching image build changes: cached images with another stamp are rebuilt.
BUSYBOX_RECIPE=1
PYTHON_RECIPE=2
PYTHON_SUITE=bookworm
# What agents run in the python image besides python3: terminals (tmux, vim, script), inotify
# tools and ps; the process-state tests (tests/tests/states_*.rs) drive each of them.
PYTHON_PACKAGES=python3,tmux,vim-tiny,inotify-tools,procps
BUSYBOX_ROOTFS="$IMAGES/busybox/rootfs"
PYTHON_ROOTFS="$IMAGES/bookworm-python/rootfs"
PYTHON_TARBALL="$IMAGES/bookworm-python.tar.zst"
# The Harbor tests (python/tests/test_harbor_*.py) run in their own venv: Harbor needs Python
# >= 3.12 (pyenv's, else python3.12 on PATH); harbor at the version of python/pyproject.toml's
# `harbor` extra.
HARBOR_PYTEST_VERSION=9.2.0
HARBOR_VENV="$CACHE/venv-harbor"
# The daemon's state dir must be on btrfs with quotas (agent/daemon/src/quota: one subvolume + qgroup
# limit per sandbox instance). Where it is not, a btrfs image in the cache is mounted there.
STATE_DIR=/var/lib/belayer
STATE_IMAGE="$CACHE/state.btrfs"
TEST_STATE_ROOT="$STATE_DIR/test-runs"

log() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

apt_packages=(
  build-essential pkg-config clang llvm libbpf-dev bpftool
  libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler python3-protobuf
  libcap-dev libnl-3-dev libnet1-dev libbsd-dev uuid-dev libaio-dev libgnutls28-dev libnftables-dev
  busybox-static debootstrap debian-archive-keyring iproute2 xz-utils zstd tar
  # CRIU runs iptables-restore to lock the network of a sandbox in its own net namespace
  iptables
  # `belayer-bench capture` compares against runc checkpoint/restore
  runc
  # test helpers, rustup bootstrap, shell lint; patch applies scripts/criu-patches
  patch python3 curl ca-certificates util-linux kmod shellcheck
  # libseccomp builds the sandbox's seccomp filter (a binary tree over syscall numbers)
  libseccomp-dev
  # mkfs.btrfs for the state file system and the quota tests' images (belayerd itself uses ioctls)
  btrfs-progs
  # OCI image tests and the image benchmark: a real registry on loopback, images built with
  # umoci and pushed with skopeo, htpasswd (bcrypt) for the registry's basic auth
  docker-registry skopeo umoci apache2-utils
)

install_packages() {
  local installed missing=() p
  installed=$(dpkg-query -W -f='${Package} ${Status}\n' "${apt_packages[@]}" 2>/dev/null || true)
  for p in "${apt_packages[@]}"; do
    grep -qx "$p install ok installed" <<<"$installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  log "packages: ok (${#apt_packages[@]})"
}

# The patches applied to CRIU's source before the build (scripts/criu-patches, in name order),
# named by a hash: a binary or a build tree with another stamp is rebuilt.
criu_patch_stamp() {
  local p
  for p in "$CRIU_PATCHES"/*.patch; do
    if [ -f "$p" ]; then cat "$p"; fi
  done | sha256sum | cut -c1-16
}

install_criu() {
  local stamp mark="$CRIU_BIN.patches"
  stamp=$(criu_patch_stamp)
  if [ -x "$CRIU_BIN" ] && [[ "$("$CRIU_BIN" --version 2>/dev/null || true)" == *"Version: $CRIU_VERSION"* ]] \
    && [ "$(cat "$mark" 2>/dev/null || true)" = "$stamp" ]; then
    log "criu: $CRIU_BIN is $CRIU_VERSION (patches $stamp)"
    return
  fi
  local src="$CACHE/criu-$CRIU_VERSION"
  if [ ! -x "$src/criu/criu" ] || [ "$(cat "$src/.belayer-patches" 2>/dev/null || true)" != "$stamp" ]; then
    local tarball="$CACHE/criu_$CRIU_VERSION.orig.tar.xz"
    if [ ! -f "$tarball" ]; then
      log "fetching CRIU $CRIU_VERSION source"
      local list=/etc/apt/sources.list.d/belayer-criu-src.list mirror
      mirror=$(debian_mirror)
      rm -f /etc/apt/sources.list.d/belayer-trixie-src.list
      echo "deb-src $mirror $CRIU_SUITE main" > "$list"
      apt-get update -qq
      # The Debian packaging files may answer 404 while the orig tarball downloads: check for
      # the tarball, not the exit code.
      (cd "$CACHE" && { apt-get source --download-only "criu=$CRIU_VERSION-1" >/dev/null 2>&1 || true; })
      rm -f "$list"
      [ -f "$tarball" ] || die "could not fetch $tarball"
    fi
    rm -rf "$src" && mkdir -p "$src"
    tar -xJf "$tarball" -C "$src" --strip-components=1
    local p
    for p in "$CRIU_PATCHES"/*.patch; do
      [ -f "$p" ] || continue
      patch -d "$src" -p1 --forward --fuzz=0 --quiet < "$p" || die "CRIU patch $(basename "$p") does not apply"
    done
    log "building CRIU $CRIU_VERSION, patches $stamp (log: $CACHE/criu-build.log)"
    make -C "$src" -j"$(nproc)" criu >"$CACHE/criu-build.log" 2>&1 || { tail -30 "$CACHE/criu-build.log"; exit 1; }
    echo "$stamp" > "$src/.belayer-patches"
  fi
  install -m 0755 "$src/criu/criu" "$CRIU_BIN"
  echo "$stamp" > "$mark"
  log "criu: installed $CRIU_VERSION (patches $stamp) at $CRIU_BIN"
}

# The Rust toolchain pinned in rust-toolchain.toml, with clippy and rustfmt.
install_rust() {
  export PATH="$HOME/.cargo/bin:$PATH"
  local toolchain
  toolchain=$(sed -n 's/^[[:space:]]*channel[[:space:]]*=[[:space:]]*"\([^"]*\)".*/\1/p' "$REPO_ROOT/rust-toolchain.toml")
  [ -n "$toolchain" ] || die "no channel in $REPO_ROOT/rust-toolchain.toml"
  command -v rustup >/dev/null || die "rustup is required (install the Rust toolchain manager first)"
  local have
  have=$(rustup component list --installed --toolchain "$toolchain" 2>/dev/null || true)
  if ! grep -q '^rustc' <<<"$have" || ! grep -q '^clippy' <<<"$have" || ! grep -q '^rustfmt' <<<"$have"; then
    log "installing Rust $toolchain with clippy and rustfmt"
    rustup toolchain install "$toolchain" --profile minimal -c clippy -c rustfmt
  fi
  log "rust: $toolchain with clippy, rustfmt"
}

# pytest for the Python package's tests (python/tests), installed with pip when missing.
install_python_test_deps() {
  if ! python3 -m pytest --version >/dev/null 2>&1; then
    log "installing pytest"
    python3 -m pip install --quiet pytest >&2
  fi
  install_minisweagent
  install_prometheus_client
  log "python: $(python3 --version 2>&1), $(python3 -m pytest --version 2>&1 | head -1)"
}

# The Prometheus project's Python client: its OpenMetrics parser checks the scrapes of the
# metrics tests (tests/tests/metrics.rs); nothing when the pinned version is there.
PROMETHEUS_CLIENT_VERSION=0.26.0
install_prometheus_client() {
  local have
  have=$(python3 -c 'import importlib.metadata as m; print(m.version("prometheus_client"))' 2>/dev/null || true)
  if [ "$have" != "$PROMETHEUS_CLIENT_VERSION" ]; then
    log "installing prometheus_client $PROMETHEUS_CLIENT_VERSION${have:+ (had $have)}"
    python3 -m pip install --quiet --disable-pip-version-check \
      "prometheus_client==$PROMETHEUS_CLIENT_VERSION" >&2
  fi
}

# The version of mini-swe-agent that python/pyproject.toml pins in its `minisweagent` extra.
minisweagent_pin() {
  sed -n 's/^minisweagent = \["mini-swe-agent==\([^"]*\)"\]$/\1/p' "$REPO_ROOT/python/pyproject.toml"
}

# mini-swe-agent from PyPI at the pinned version, for the tests of
# belayer.integrations.minisweagent (python/tests/test_minisweagent.py); nothing when it is there.
install_minisweagent() {
  local want have
  want=$(minisweagent_pin)
  [ -n "$want" ] || die "no mini-swe-agent pin in python/pyproject.toml"
  have=$(python3 -c 'import importlib.metadata as m; print(m.version("mini-swe-agent"))' 2>/dev/null || true)
  if [ "$have" != "$want" ]; then
    log "installing mini-swe-agent $want${have:+ (had $have)}"
    python3 -m pip install --quiet --disable-pip-version-check "mini-swe-agent==$want" >&2
  fi
  log "mini-swe-agent $want"
}

# The venv of the Harbor tests with the pinned harbor and pytest; skipped when both match.
install_harbor_venv() {
  local py="$HARBOR_VENV/bin/python" base="" candidate HARBOR_VERSION
  HARBOR_VERSION=$(sed -n 's/^harbor = \["harbor==\([^";]*\).*/\1/p' "$REPO_ROOT/python/pyproject.toml")
  [ -n "$HARBOR_VERSION" ] || die "no harbor pin in python/pyproject.toml"
  if [ -x "$py" ] && "$py" - "$HARBOR_VERSION" "$HARBOR_PYTEST_VERSION" 2>/dev/null <<'PY'
import importlib.metadata as m, sys
sys.exit(0 if [m.version("harbor"), m.version("pytest")] == sys.argv[1:] else 1)
PY
  then
    log "harbor: $HARBOR_VENV has harbor $HARBOR_VERSION"
    return
  fi
  for candidate in "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python; do
    [ -x "$candidate" ] && { base=$candidate; break; }
  done
  [ -n "$base" ] || base=$(command -v python3.12 || true)
  [ -n "$base" ] || die "Harbor needs Python >= 3.12 (pyenv install 3.12, or python3.12 on PATH)"
  log "harbor: making $HARBOR_VENV with $base (harbor $HARBOR_VERSION, pytest $HARBOR_PYTEST_VERSION)"
  [ -x "$py" ] || "$base" -m venv "$HARBOR_VENV"
  "$py" -m pip install --quiet --disable-pip-version-check \
    "harbor==$HARBOR_VERSION" "pytest==$HARBOR_PYTEST_VERSION" >&2
  log "harbor: $HARBOR_VENV ready"
}

# Prints the first Debian mirror that the machine's apt configuration uses for $PYTHON_SUITE
# (deb822 *.sources first, then one-line sources.list entries).
debian_mirror() {
  if [ -n "${BELAYER_DEBIAN_MIRROR:-}" ]; then
    echo "$BELAYER_DEBIAN_MIRROR"
    return
  fi
  local f mirror=""
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    mirror=$(awk -v suite="$PYTHON_SUITE" '
      BEGIN { RS = ""; FS = "\n" }
      {
        types = ""; uris = ""; suites = ""; enabled = "yes"
        for (i = 1; i <= NF; i++) {
          if ($i ~ /^Types:/) types = " " substr($i, 7) " "
          else if ($i ~ /^URIs:/) uris = substr($i, 6)
          else if ($i ~ /^Suites:/) suites = " " substr($i, 8) " "
          else if ($i ~ /^Enabled:/) enabled = substr($i, 9)
        }
        gsub(/[[:space:]]+/, " ", types); gsub(/[[:space:]]+/, " ", suites)
        if (enabled ~ /no/ || types !~ / deb / || suites !~ (" " suite " ")) next
        split(uris, u, /[[:space:]]+/)
        for (j = 1; j in u; j++) if (u[j] != "") { print u[j]; exit }
      }' "$f")
    if [ -n "$mirror" ]; then break; fi
  done
  if [ -z "$mirror" ]; then
    mirror=$( { cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true; } | awk -v suite="$PYTHON_SUITE" '
      $1 == "deb" {
        i = 2
        if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
        if ($(i + 1) == suite) { print $i; exit }
      }')
  fi
  [ -n "$mirror" ] || die "no '$PYTHON_SUITE' mirror in /etc/apt/sources.list*; set BELAYER_DEBIAN_MIRROR"
  echo "${mirror%/}"
}

# Kernel features Belayer needs; every missing one is reported, then the script fails.
check_kernel() {
  local missing=() capeff cg2 probe ctrl where
  capeff=$(awk '/^CapEff:/ { print $2 }' /proc/self/status)
  if (( (16#$capeff >> 21) & 1 )); then
    log "kernel: CAP_SYS_ADMIN present"
  else
    missing+=("CAP_SYS_ADMIN (run as root with full capabilities)")
  fi

  grep -qw overlay /proc/filesystems || modprobe overlay 2>/dev/null || true
  if grep -qw overlay /proc/filesystems; then
    log "kernel: overlayfs present"
  else
    missing+=("overlayfs (CONFIG_OVERLAY_FS; modprobe overlay failed)")
  fi

  cg2=$(awk '{ for (i = 7; i <= NF; i++) if ($i == "-") { if ($(i + 1) == "cgroup2") { print $5; exit } break } }' \
    /proc/self/mountinfo)
  if [ -z "$cg2" ]; then
    missing+=("a cgroup v2 mount (mount -t cgroup2 none /sys/fs/cgroup/unified)")
  else
    probe="$cg2/belayer-setup-probe.$$"
    if mkdir "$probe" 2>/dev/null; then
      if [ -e "$probe/cgroup.freeze" ] && [ -e "$probe/cgroup.kill" ]; then
        log "kernel: cgroup v2 at $cg2 with cgroup.freeze and cgroup.kill"
      else
        missing+=("cgroup.freeze/cgroup.kill in cgroup v2 at $cg2 (kernel >= 5.14)")
      fi
      rmdir "$probe"
    else
      missing+=("a writable cgroup v2 hierarchy at $cg2")
    fi
  fi

  for ctrl in memory pids; do
    where=""
    if [ -n "$cg2" ] && grep -qw "$ctrl" "$cg2/cgroup.controllers" 2>/dev/null; then
      where="v2 $cg2"
    else
      where=$(awk -v c="$ctrl" '{
        for (i = 7; i <= NF; i++) if ($i == "-") {
          if ($(i + 1) == "cgroup") { n = split($NF, o, ","); for (j = 1; j <= n; j++) if (o[j] == c) { print "v1 " $5; exit } }
          break
        } }' /proc/self/mountinfo)
    fi
    if [ -n "$where" ]; then
      log "kernel: $ctrl controller ($where)"
    else
      missing+=("the $ctrl cgroup controller (neither v2 nor v1)")
    fi
  done

  local out
  if out=$("$CRIU_BIN" check 2>&1); then
    log "kernel: criu check: ${out//$'\n'/ }"
  else
    missing+=("criu check: ${out//$'\n'/ }")
  fi

  [ -e /sys/kernel/btf/vmlinux ] || log "warning: no /sys/kernel/btf/vmlinux (BPF CO-RE programs will not load)"

  if [ ${#missing[@]} -gt 0 ]; then
    local m
    for m in "${missing[@]}"; do log "error: missing kernel feature: $m"; done
    exit 1
  fi
}

# Temporary build directories, removed on exit unless published.
TMP_DIRS=()

# Removes a directory tree that may hold mounts (debootstrap mounts /proc and /sys in its target):
# unmounts everything below it, deepest first, then deletes without crossing file systems.
remove_tree() {
  local dir=$1 m
  [ -e "$dir" ] || return 0
  dir=$(realpath "$dir")
  awk -v d="$dir" '$5 == d || index($5, d "/") == 1 { print $5 }' /proc/self/mountinfo | sort -r \
    | while read -r m; do
    umount -l "$m" || true
  done
  rm -rf --one-file-system "$dir"
}

cleanup_tmp() {
  local d
  for d in "${TMP_DIRS[@]}"; do remove_tree "$d"; done
  TMP_DIRS=()
}

# Makes a build directory beside the images (same file system, so the final rename is atomic).
make_tmp() {
  local d
  d=$(mktemp -d "$IMAGES/.tmp.$1.XXXXXX")
  TMP_DIRS+=("$d")
  echo "$d"
}

# Replaces the directory $2 by $1: a rename, so readers see the old image or the new one, never half.
publish_dir() {
  local built=$1 final=$2 stale=""
  if [ -e "$final" ]; then
    stale="$final.stale.$$"
    mv -T "$final" "$stale"
  fi
  mv -T "$built" "$final"
  [ -z "$stale" ] || remove_tree "$stale"
}

# Removes build leftovers of an earlier, interrupted run (the caller holds the set-up lock).
clean_stale_tmp() {
  local d
  for d in "$IMAGES"/.tmp.* "$IMAGES"/*.stale.* "$PYTHON_TARBALL".part.* "$STATE_IMAGE".part.*; do
    [ -e "$d" ] || continue
    log "removing leftover $d"
    remove_tree "$d"
  done
}

stamp_matches() { [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; }

# A minimal rootfs: busybox-static with a symlink per applet, the usual top-level dirs, root user.
build_busybox_image() {
  local stamp bb_version
  bb_version=$(/bin/busybox 2>/dev/null | head -1 || true)
  stamp="recipe=$BUSYBOX_RECIPE $bb_version"
  if [ -x "$BUSYBOX_ROOTFS/bin/sh" ] && stamp_matches "$IMAGES/busybox/stamp" "$stamp"; then
    log "image: busybox at $BUSYBOX_ROOTFS"
    return
  fi
  log "image: building busybox ($bb_version)"
  local tmp root applet
  tmp=$(make_tmp busybox)
  root="$tmp/rootfs"
  mkdir -p "$root"/{bin,dev,etc,home,proc,root,run,sys,tmp,usr,var/tmp}
  chmod 0755 "$tmp" "$root"
  chmod 0700 "$root/root"
  chmod 1777 "$root/tmp" "$root/var/tmp"
  ln -s bin "$root/sbin"
  ln -s ../bin "$root/usr/bin"
  ln -s ../bin "$root/usr/sbin"
  install -m 0755 /bin/busybox "$root/bin/busybox"
  /bin/busybox --list | while read -r applet; do
    [ "$applet" = busybox ] || ln -s busybox "$root/bin/$applet"
  done
  [ -e "$root/bin/sh" ] || die "busybox has no sh applet"
  cat >"$root/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
EOF
  cat >"$root/etc/group" <<'EOF'
root:x:0:
nogroup:x:65534:
EOF
  echo sandbox >"$root/etc/hostname"
  printf '127.0.0.1\tlocalhost\n::1\tlocalhost\n' >"$root/etc/hosts"
  echo "$stamp" >"$tmp/stamp"
  publish_dir "$tmp" "$IMAGES/busybox"
  log "image: busybox ready at $BUSYBOX_ROOTFS"
}

# Removes what a read-only sandbox image does not need (package lists, caches, docs, logs).
strip_rootfs() {
  local root=$1
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/var/cache/debconf/*-old \
    "$root"/var/log/* "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* \
    "$root"/usr/share/lintian "$root"/usr/share/bug
  find "$root/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} + 2>/dev/null || true
  echo sandbox >"$root/etc/hostname"
}

# Packs a rootfs into $PYTHON_TARBALL (atomically: written aside, then renamed) with its stamp.
pack_python_tarball() {
  local root=$1 stamp=$2 part="$PYTHON_TARBALL.part.$$"
  log "image: packing $PYTHON_TARBALL"
  tar --numeric-owner --xattrs --xattrs-include='*' -C "$root" -cf - . | zstd -q -T0 -6 -o "$part"
  mv -f "$part" "$PYTHON_TARBALL"
  echo "$stamp" >"$PYTHON_TARBALL.stamp"
}

# Shows debootstrap's phase lines (not one line per package) on stderr; never fails.
debootstrap_progress() {
  awk '
    $2 == "Retrieving" && NF == 4 {
      if (++n % 25 == 0) { printf "[setup]   debootstrap: %d packages retrieved\n", n; fflush() }
      next
    }
    /(packages|system)\.\.\.$|successfully|Retrieving (InRelease|Packages)|Valid Release|Checking component|^[EW]:/ {
      print "[setup]   debootstrap: " $0; fflush()
    }' >&2 || true
}

# Debian bookworm (minbase + $PYTHON_PACKAGES) made by debootstrap, cached as a dir and as a tarball.
build_python_image() {
  local stamp="recipe=$PYTHON_RECIPE suite=$PYTHON_SUITE packages=$PYTHON_PACKAGES"
  if [ -x "$PYTHON_ROOTFS/usr/bin/python3" ] && stamp_matches "$IMAGES/bookworm-python/stamp" "$stamp"; then
    if ! stamp_matches "$PYTHON_TARBALL.stamp" "$stamp" || [ ! -f "$PYTHON_TARBALL" ]; then
      pack_python_tarball "$PYTHON_ROOTFS" "$stamp"
    fi
    log "image: bookworm-python at $PYTHON_ROOTFS"
    return
  fi
  local tmp root
  tmp=$(make_tmp bookworm-python)
  root="$tmp/rootfs"
  mkdir "$root"
  chmod 0755 "$tmp" "$root"
  if [ -f "$PYTHON_TARBALL" ] && stamp_matches "$PYTHON_TARBALL.stamp" "$stamp"; then
    log "image: extracting bookworm-python from $PYTHON_TARBALL"
    zstd -q -dc "$PYTHON_TARBALL" | tar --numeric-owner --xattrs --xattrs-include='*' -xpf - -C "$root"
  else
    local mirror start=$SECONDS dlog="$CACHE/debootstrap.log"
    mirror=$(debian_mirror)
    log "image: debootstrap $PYTHON_SUITE minbase + python3 from $mirror (a few minutes; log: $dlog)"
    if ! debootstrap --variant=minbase --include="$PYTHON_PACKAGES" "$PYTHON_SUITE" "$root" "$mirror" 2>&1 \
        | tee "$dlog" | debootstrap_progress; then
      tail -20 "$dlog" >&2
      die "debootstrap failed (log: $dlog)"
    fi
    # Check the result itself rather than trusting the exit status alone.
    [ -x "$root/usr/bin/python3" ] || die "debootstrap left no /usr/bin/python3 (log: $dlog)"
    strip_rootfs "$root"
    log "image: debootstrap done in $((SECONDS - start)) s"
    pack_python_tarball "$root" "$stamp"
  fi
  echo "$stamp" >"$tmp/stamp"
  publish_dir "$tmp" "$IMAGES/bookworm-python"
  log "image: bookworm-python ready at $PYTHON_ROOTFS"
}

# Turns btrfs quotas on for the file system holding $1: simple quotas (Linux >= 6.7: extents are
# charged to the subvolume that wrote them, no backref walks at commit), else full qgroups. The
# ioctl is used directly because btrfs-progs 6.2 (Debian 12) cannot enable simple quotas.
# Enabling quotas that are on already changes nothing.
enable_quotas() {
  python3 - "$1" <<'PY'
import errno, fcntl, os, struct, sys
BTRFS_IOC_QUOTA_CTL = 0xC0109428
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
for cmd, mode in ((4, "simple quotas"), (1, "full qgroups")):
    try:
        fcntl.ioctl(fd, BTRFS_IOC_QUOTA_CTL, bytearray(struct.pack("=QQ", cmd, 0)))
        print(mode)
        break
    except OSError as e:
        if cmd == 1 or e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
PY
}

quotas_on() { btrfs qgroup show "$1" >/dev/null 2>&1; }

# Bytes for a new state image: $BELAYER_STATE_IMAGE_SIZE, else half the free space of the cache's
# file system (the image is sparse: other users of that disk keep the other half), at most 256 GiB.
state_image_size() {
  if [ -n "${BELAYER_STATE_IMAGE_SIZE:-}" ]; then
    echo "$BELAYER_STATE_IMAGE_SIZE"
    return
  fi
  local avail gib=$((1 << 30)) size
  avail=$(df -B1 --output=avail "$CACHE" | tail -1 | tr -d ' ')
  size=$(( avail / 2 / gib * gib ))
  (( size <= 256 * gib )) || size=$(( 256 * gib ))
  (( size >= 8 * gib )) || die "a state image needs 16 GiB free in $CACHE (or set BELAYER_STATE_IMAGE_SIZE)"
  echo "$size"
}

# The state file system: nothing to do when $STATE_DIR is on btrfs with quotas on (≈0 s). Else
# a btrfs image $STATE_IMAGE (made once) is attached to a loop device with direct I/O (no second
# copy of the data in the host's page cache; fsync costs about half of a buffered loop) and
# mounted at $STATE_DIR, and quotas are turned on. The mount does not survive a reboot: run
# set-up again (it re-attaches the cached image) or see scripts/systemd/belayerd.service.
setup_state_fs() {
  mkdir -p "$STATE_DIR"
  local fstype
  fstype=$(stat -f -c %T "$STATE_DIR")
  if [ "$fstype" != btrfs ]; then
    mountpoint -q "$STATE_DIR" && die "$STATE_DIR is a $fstype mount: Belayer needs btrfs there (disk quotas per sandbox)"
    if [ -n "$(find "$STATE_DIR" -mindepth 1 ! -type d -print -quit)" ]; then
      die "$STATE_DIR holds files on $fstype: move them away (set-up mounts a btrfs image there) or put $STATE_DIR on btrfs"
    fi
    if [ ! -f "$STATE_IMAGE" ]; then
      local size part="$STATE_IMAGE.part.$$"
      size=$(state_image_size)
      log "state: making a $size-byte btrfs image $STATE_IMAGE"
      if [ "${BELAYER_STATE_IMAGE_PREALLOCATE:-0}" = 1 ]; then
        fallocate -l "$size" "$part"
      else
        truncate -s "$size" "$part"
      fi
      # Metadata single, not DUP: a second copy on the same backing file protects nothing.
      mkfs.btrfs -q -f -L belayer-state -m single "$part" >/dev/null
      mv -f "$part" "$STATE_IMAGE"
    fi
    local dev
    dev=$(losetup -n -O NAME -j "$STATE_IMAGE" | head -1)
    [ -n "$dev" ] || dev=$(losetup --find --show --direct-io=on "$STATE_IMAGE")
    mount "$dev" "$STATE_DIR"
    chmod 0700 "$STATE_DIR"
    log "state: mounted $STATE_IMAGE ($dev) at $STATE_DIR"
  fi
  if ! quotas_on "$STATE_DIR"; then
    log "state: enabled $(enable_quotas "$STATE_DIR") on $STATE_DIR"
  fi
  mkdir -p "$TEST_STATE_ROOT"
  log "state: $STATE_DIR on btrfs with quotas"
}

# Host tuning for agent loops: every action joins the sandbox cgroup, and a join (a write to
# cgroup.procs) takes the kernel's cgroup_threadgroup_rwsem for writing, which waits for an RCU
# grace period (≈5 ms on these VMs) unless the cgroup2 hierarchy is mounted with
# `favordynmods` (Linux >= 6.0; fork and exit pay a little more in exchange). Set once per boot
# (≈0 s when it is already on); BELAYER_CGROUP_FAVORDYNMODS=0 leaves the mount alone.
tune_cgroups() {
  [ "${BELAYER_CGROUP_FAVORDYNMODS:-1}" = 1 ] || { log "cgroup: favordynmods left alone"; return; }
  local mnt opts
  read -r mnt opts < <(awk '$3 == "cgroup2" { print $2, $4; exit }' /proc/mounts)
  [ -n "${mnt:-}" ] || { log "cgroup: no cgroup2 mount; nothing to tune"; return; }
  case ",$opts," in
    *,favordynmods,*) log "cgroup: $mnt has favordynmods" ;;
    *) if mount -o remount,favordynmods "$mnt" 2>/dev/null; then
         log "cgroup: remounted $mnt with favordynmods (faster cgroup joins per action)"
       else
         log "cgroup: could not remount $mnt with favordynmods (kernel < 6.0?); actions pay an RCU grace period per cgroup join"
       fi ;;
  esac
}

main() {
  [ "$(id -u)" -eq 0 ] || die "run as root"
  local start=$SECONDS
  mkdir -p "$CACHE" "$IMAGES"
  # One set-up at a time on a machine: concurrent runs wait here.
  exec 9>"$CACHE/setup.lock"
  flock 9
  trap cleanup_tmp EXIT
  trap 'exit 130' INT TERM
  clean_stale_tmp

  # Everything but the final export lines goes to stderr, so that stdout can be eval'd.
  {
    install_packages
    install_criu
    install_rust
    install_python_test_deps
    install_harbor_venv
    check_kernel
    tune_cgroups
    build_busybox_image
    build_python_image
    setup_state_fs
  } >&2

  cleanup_tmp
  exec 9>&-
  export BELAYER_TEST_BUSYBOX_ROOTFS="$BUSYBOX_ROOTFS"
  export BELAYER_TEST_PYTHON_ROOTFS="$PYTHON_ROOTFS"
  log "done in $((SECONDS - start)) s"
  printf 'export BELAYER_TEST_BUSYBOX_ROOTFS=%q\n' "$BUSYBOX_ROOTFS"
  printf 'export BELAYER_TEST_PYTHON_ROOTFS=%q\n' "$PYTHON_ROOTFS"
  printf 'export BELAYER_TEST_PYTHON_TARBALL=%q\n' "$PYTHON_TARBALL"
  printf 'export BELAYER_CRIU=%q\n' "$CRIU_BIN"
  printf 'export BELAYER_TEST_STATE_ROOT=%q\n' "$TEST_STATE_ROOT"
  printf 'export BELAYER_HARBOR_VENV=%q\n' "$HARBOR_VENV"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  main "$@"
fi
