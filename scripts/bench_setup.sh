# Sourced by the benchmark scripts: builds attnkit-bench and makes their scratch folder.
# bench_setup LIBTORCH2 PREFIX: builds build/apps/attnkit-bench, and with LIBTORCH2 = true
# also build-libtorch2/apps/attnkit-bench in the Debian 13 root of scripts/debian13.sh; sets
# $work to a fresh folder (removed on exit) inside the repository, so that the Debian 13 root
# (which has its own /tmp) sees it too.
bench_setup() {
  scripts/build.sh --target attnkit-bench >/dev/null
  if "$1"; then
    scripts/debian13.sh bash -c 'cmake --preset libtorch2 >/dev/null && cmake --build --preset libtorch2 --target attnkit-bench >/dev/null'
  fi
  mkdir -p build
  work=$(mktemp -d "$PWD/build/$2.XXXXXX")
  trap 'rm -rf "$work"' EXIT
}
