#!/usr/bin/env bash
# Run a command inside a QEMU VM that has a soft-RoCE device (rxe0 on dummy
# netdev d0, IP 10.99.0.1/24), with the host's / mounted read-only as the VM's
# root. Exits with the command's exit status and prints its output.
#
#   tests/rdma/run_in_vm.sh CMD [ARG...]
#   e.g. tests/rdma/run_in_vm.sh "$PWD/.venv/bin/python" -m pytest -p no:cacheprovider tests -m rdma
#
# The command runs as root in the current directory, with PATH, HOME, LANG,
# VIRTUAL_ENV, PYTHONPATH and every MEMSEM_* / PYTEST_* variable passed through
# (add names with MEMSEM_VM_PASS_ENV="A B"). Everything but $MEMSEM_VM_OUT,
# /tmp, /var/tmp, /run and /dev/shm (tmpfs) is read-only inside. Build any native code
# on the host first. Use absolute paths (or PATH) to programs.
#
# Environment:
#   MEMSEM_VM_TIMEOUT  seconds for the whole VM (default 600); the command gets 20 s less
#   MEMSEM_VM_MEM      VM memory (default 3G);  MEMSEM_VM_SMP  vCPUs (default 2)
#   MEMSEM_VM_CPU      QEMU -cpu model (default Nehalem = x86-64-v2, no AVX: under TCG
#                      it ran the RDMA path ~3x faster than -cpu max, whose AVX2 and
#                      crc32-pclmul (rxe ICRC) are slow to emulate)
#   MEMSEM_VM_OUT      host dir for results (cleared; default a fresh dir under the
#                      cache, removed afterwards); writable inside the VM at the same path
#   MEMSEM_VM_CACHE    cache dir (default tests/rdma/.cache)
#   MEMSEM_VM_VERBOSE  1: show the VM console (kernel log) after the run
# Exit status: the command's; 124 timeout; 125 the VM failed before running it.
set -euo pipefail

[ $# -ge 1 ] || { echo "usage: $0 CMD [ARG...]" >&2; exit 2; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
t_start=$(date +%s.%N)

read -r kernel initrd < <("$here/vm/build.sh")
cache=$(dirname "$initrd")

timeout_s=${MEMSEM_VM_TIMEOUT:-600}
if [ -n "${MEMSEM_VM_OUT:-}" ]; then
    out=$MEMSEM_VM_OUT
    mkdir -p "$out"
    out=$(cd "$out" && pwd)
    find "$out" -mindepth 1 -delete
    keep=1
else
    mkdir -p "$cache/runs"
    out=$(mktemp -d "$cache/runs/run.XXXXXX")
    keep=${MEMSEM_VM_KEEP:-0}
fi

q() { local s=${1//\'/\'\\\'\'}; printf "'%s'" "$s"; }  # POSIX sh single-quoting (job.sh runs under /bin/sh)
{
    echo "VM_RESULTS=$(q "$out")"
    echo "VM_TIMEOUT=$((timeout_s > 40 ? timeout_s - 20 : timeout_s))"
    echo "VM_NETDEV=d0"
    echo "VM_IP=10.99.0.1/24"
    echo "VM_RXE=rxe0"
} >"$out/job.conf"
{
    echo "cd $(q "$PWD")"
    echo "export MEMSEM_VM_OUT=$(q "$out") MEMSEM_IN_VM=1 TMPDIR=/run/tmp PYTHONDONTWRITEBYTECODE=1"
    for v in PATH HOME LANG LC_ALL TERM VIRTUAL_ENV PYTHONPATH ${MEMSEM_VM_PASS_ENV:-} \
             $(compgen -e | grep -E '^(MEMSEM_|PYTEST_)' | grep -vE '^MEMSEM_(VM_OUT|IN_VM)$' || true); do
        [ -n "${!v+x}" ] && echo "export $v=$(q "${!v}")"
    done
    printf 'exec'
    for a in "$@"; do printf ' %s' "$(q "$a")"; done
    echo
} >"$out/job.sh"

set +e
timeout -k 10 "$timeout_s" qemu-system-x86_64 \
    -nodefaults -nographic -no-reboot \
    -machine q35 -accel tcg,thread=multi -cpu "${MEMSEM_VM_CPU:-Nehalem}" \
    -smp "${MEMSEM_VM_SMP:-2}" -m "${MEMSEM_VM_MEM:-3G}" \
    -kernel "$kernel" -initrd "$initrd" \
    -append "console=ttyS0 quiet panic=-1 mitigations=off" \
    -serial "file:$out/console.log" -monitor none -nic none \
    -fsdev local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap \
    -device virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot \
    -fsdev local,id=results,path="$out",security_model=none,multidevs=remap \
    -device virtio-9p-pci,fsdev=results,mount_tag=results \
    </dev/null >"$out/qemu.log" 2>&1
qrc=$?
set -e
t_end=$(date +%s.%N)

[ -f "$out/output.log" ] && cat "$out/output.log"
if [ -f "$out/rc" ]; then
    rc=$(cat "$out/rc")
    if [ -f "$out/timed_out" ]; then
        echo "memsem-vm: command killed after its timeout" >&2
        rc=124
    fi
elif [ "$qrc" = 124 ] || [ "$qrc" = 137 ]; then
    echo "memsem-vm: VM timed out after ${timeout_s}s" >&2
    rc=124
else
    echo "memsem-vm: VM failed before the command finished (qemu exit $qrc)" >&2
    rc=125
fi
if [ "$rc" = 124 ] || [ "$rc" = 125 ] || [ "${MEMSEM_VM_VERBOSE:-0}" = 1 ]; then
    for f in vm-error setup.log qemu.log console.log; do
        [ -s "$out/$f" ] && { echo "--- $f" >&2; tail -n 60 "$out/$f" >&2; }
    done
fi
boot=$(sed -n 's/^boot_s=//p' "$out/times" 2>/dev/null || true)
job_end=$(sed -n 's/^job_end_s=//p' "$out/times" 2>/dev/null || true)
awk -v s="$t_start" -v e="$t_end" -v b="${boot:-?}" -v j="${job_end:-?}" 'BEGIN {
    printf "memsem-vm: wall %.1fs (guest: boot+setup %ss, command done at %ss)\n", e - s, b, j }' >&2
[ "$keep" = 1 ] || rm -rf "$out"
exit "$rc"
