#!/usr/bin/env bash
# Runs a command inside a Debian 13 (trixie) root, where LibTorch and PyTorch are 2.6: the
# second CI leg (scripts/test.sh --libtorch2) and the Python 2.6 side of the benchmarks.
#
# Usage: scripts/debian13.sh COMMAND [ARGS...]
#   scripts/debian13.sh scripts/test.sh --preset libtorch2
#   scripts/debian13.sh python3 -c 'import torch; print(torch.__version__)'
#
# The root is made once with debootstrap from Debian's archive and reused; scripts/setup.sh,
# run inside it, installs the same packages as on the host (Debian 13's versions). The host's
# packages are never touched. The repository is mounted inside at its own path, so COMMAND
# runs in the same folder and sees the same files; build folders of the two legs are separate
# (CMake preset libtorch2: build-libtorch2/). Every mount is undone when the script exits,
# also when COMMAND or a set-up step fails.
#
# Environment:
#   ATTNKIT_DEBIAN13_ROOT   where the root lives (default: $XDG_CACHE_HOME/attnkit/debian13,
#                           or ~/.cache/attnkit/debian13); to start afresh, delete it with
#                           `rm -rf --one-file-system` while no run uses it (a run killed
#                           outright can leave the host's /dev and the repository mounted
#                           inside it; the next run undoes such mounts first)
#   ATTNKIT_DEBIAN_MIRROR   the archive debootstrap uses (default: debootstrap's own)
#   CI, ATTNKIT_WERROR, ATTNKIT_CCACHE, ATTNKIT_UNITY_BUILD
#                           passed on to COMMAND (the build's settings: .ci/run,
#                           scripts/compiler_cache.sh); the rest of the environment is not
# Needs root (or sudo) for debootstrap, mount and chroot; COMMAND runs as the calling user.
set -euo pipefail

[ $# -ge 1 ] || { echo "usage: scripts/debian13.sh COMMAND [ARGS...]" >&2; exit 2; }
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "debian13: needs root or sudo (debootstrap, mount, chroot)" >&2; exit 1; }
  exec sudo --preserve-env=ATTNKIT_DEBIAN13_ROOT,ATTNKIT_DEBIAN_MIRROR,XDG_CACHE_HOME,CI,ATTNKIT_WERROR,ATTNKIT_CCACHE,ATTNKIT_UNITY_BUILD \
    HOME="$HOME" "$0" "$@"
fi

repo=$(cd "$(dirname "$0")/.." && pwd)
root=${ATTNKIT_DEBIAN13_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/attnkit/debian13}
mkdir -p "$(dirname "$root")"

# One user of the root at a time (a second run waits here).
exec 9>"$root.lock"
flock 9

# Unmounts everything mounted at or below DIR, deepest first.
unmount_under() {
  local dir=$1
  awk -v dir="$dir" '$2 == dir || index($2, dir "/") == 1 { print $2 }' /proc/mounts |
    sort -r | while read -r target; do umount -l "$target"; done
}
trap 'unmount_under "$root"; unmount_under "$root.partial"' EXIT
# A run killed outright (SIGKILL) leaves its mounts behind, among them a bind of a folder
# that may since be deleted. The lock is ours, so whatever is mounted under the root now is
# such a leftover: undone before anything is mounted again.
unmount_under "$root"

run_inside() {  # run_inside [--as-caller] COMMAND...: in the repository folder, clean environment
  local userspec=()
  if [ "${1:-}" = "--as-caller" ]; then
    shift
    [ -n "${SUDO_UID:-}" ] && userspec=(--userspec="$SUDO_UID:$SUDO_GID")
  fi
  chroot "${userspec[@]}" "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin TERM="${TERM:-dumb}" \
    CI="${CI:-}" ATTNKIT_WERROR="${ATTNKIT_WERROR:-}" ATTNKIT_CCACHE="${ATTNKIT_CCACHE:-}" ATTNKIT_UNITY_BUILD="${ATTNKIT_UNITY_BUILD:-}" bash -c 'cd "$0" && exec "$@"' "$repo" "$@"
}

if [ ! -e "$root/etc/attnkit-debian13-complete" ]; then
  command -v debootstrap >/dev/null || {
    echo "debian13: installing debootstrap on the host (from Debian's archive)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
  }
  # Built under a temporary name and renamed when complete: an interrupted run starts over.
  unmount_under "$root.partial"
  rm -rf --one-file-system "$root.partial" "$root"
  echo "debian13: creating a Debian 13 root in $root with debootstrap (a few minutes, once)"
  debootstrap --variant=minbase trixie "$root.partial" ${ATTNKIT_DEBIAN_MIRROR:+"$ATTNKIT_DEBIAN_MIRROR"} \
    >"$root.debootstrap.log" 2>&1 ||
    { tail -n 20 "$root.debootstrap.log" >&2; echo "debian13: debootstrap failed (log: $root.debootstrap.log)" >&2; exit 1; }
  unmount_under "$root.partial"
  touch "$root.partial/etc/attnkit-debian13-complete"
  mv "$root.partial" "$root"
fi

mkdir -p "$root/proc" "$root/dev" "$root$repo"
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"  # with /dev/pts and /dev/shm
mount --make-rslave "$root/dev"  # so that unmounting here never reaches the host's /dev
mount --bind "$repo" "$root$repo"
cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true

# The project's own package list, Debian 13's versions (prints nothing when all are there).
run_inside bash scripts/setup.sh
run_inside --as-caller "$@"
