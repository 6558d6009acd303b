#!/usr/bin/env bash
# Run the RDMA engine tests (tests/test_rdma.py) on a real soft-RoCE device inside the QEMU VM.
#
#   tests/rdma/run_rdma_tests.sh [PYTEST ARG...]
#
# 1. makes VENV (default: the repo's .venv; it must already have memsem installed, e.g. by
#    `make`'s test stamp) usable inside the VM: pytest + pytest-timeout present, Debian's
#    pyverbs linked in (tests/rdma/install_pyverbs.sh; installs python3-pyverbs with apt when
#    missing). Everything is built on the host: the VM sees the host's / read-only.
# 2. prepares the VM (tests/rdma/vm/build.sh: kernel, busybox, initramfs; cached),
# 3. runs pytest on tests/test_rdma.py in the VM against rxe0, prints the VM's wall time and
#    exits with pytest's status (124: VM timeout, 125: the VM failed to start the command).
#
# Environment: MEMSEM_RDMA_VENV (default <repo>/.venv), MEMSEM_VM_TIMEOUT (default 300 s), and
# everything tests/rdma/run_in_vm.sh reads.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=${MEMSEM_RDMA_VENV:-$root/.venv}
say() { echo "memsem-rdma: $*" >&2; }

[ -x "$venv/bin/python" ] || { say "no venv at $venv (run make first, or set MEMSEM_RDMA_VENV)"; exit 2; }
venv=$(cd "$venv" && pwd)
case $venv in
    /var/tmp/*|/run/*|/dev/shm/*) say "$venv is hidden inside the VM (tmpfs there); use a venv elsewhere"; exit 2 ;;
esac
py="$venv/bin/python"
t0=$(date +%s.%N)

"$py" -c 'import memsem' 2>/dev/null || { say "memsem is not installed in $venv"; exit 2; }
if ! "$py" -c 'import pytest, pytest_timeout' 2>/dev/null; then
    say "installing pytest and pytest-timeout into $venv"
    "$py" -m pip install -q pytest pytest-timeout
fi
bash "$here/install_pyverbs.sh" "$venv" >&2
"$here/vm/build.sh" >/dev/null
t_prep=$(date +%s.%N)

cd "$root"
export MEMSEM_VM_TIMEOUT=${MEMSEM_VM_TIMEOUT:-300}
# Only the plugins this run needs (third-party plugins of a big venv are slow to import under TCG).
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
set +e
"$here/run_in_vm.sh" "$py" -m pytest -p pytest_timeout -p no:cacheprovider -q -rs \
    tests/test_rdma.py "$@"
rc=$?
set -e
t_end=$(date +%s.%N)
awk -v a="$t0" -v b="$t_prep" -v c="$t_end" -v rc="$rc" 'BEGIN {
    printf "memsem-rdma: prepare %.1f s, VM run %.1f s (boot + tests), total %.1f s; pytest exit %d\n",
           b - a, c - b, c - a, rc }' >&2
exit "$rc"
