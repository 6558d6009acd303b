#!/bin/sh
# Build the memsem shmem host emulator, a TEST DOUBLE of Ascend SHMEM's libshmem.so that
# exports the same host symbols over POSIX shared memory (no NPU involved).
#
#   native/shmem_emu/build.sh OUT_DIR      ->  OUT_DIR/libshmem_host_emu.so
#
# Use it with: MEMSEM_SHMEM_LIB=OUT_DIR/libshmem_host_emu.so
# Environment: CC (default gcc), EXTRA_CFLAGS (appended).
set -eu
if [ "$#" -ne 1 ]; then
    echo "usage: $0 OUT_DIR" >&2
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
out=$1
mkdir -p "$out"
${CC:-gcc} -O2 -fPIC -shared -pthread -std=gnu11 -Wall -Wextra \
    -fvisibility=hidden ${EXTRA_CFLAGS:-} \
    -I"$here" -o "$out/libshmem_host_emu.so.tmp.$$" "$here/libshmem_host_emu.c" -lrt
mv -f "$out/libshmem_host_emu.so.tmp.$$" "$out/libshmem_host_emu.so"
echo "$out/libshmem_host_emu.so"
