# Sourced by scripts/build.sh, scripts/test.sh and scripts/fuzz.sh: compile through ccache
# (scripts/setup.sh installs it), whose cache (~/.cache/ccache; inside the Debian 13 root,
# that root's own) outlives build folders and clones. A clean clone on a machine that built
# attnkit before compiles only what changed; a cold machine pays the whole build once.
# ATTNKIT_CCACHE=0 builds without it. The launcher is read when a build folder is first
# configured (CMAKE_CXX_COMPILER_LAUNCHER).
if [ "${ATTNKIT_CCACHE:-1}" != 0 ] && command -v ccache >/dev/null; then
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache
  # Paths below the clone are hashed relative to it, so that clones in other folders share
  # the cache; the precompiled header is used through CMake's -include, which ccache supports
  # when it may ignore the header's defines and time stamps.
  export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=true
  export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
  # Five builds (three LibTorch versions, the sanitizers, the fuzzer) with their headers.
  export CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-12G}
fi
