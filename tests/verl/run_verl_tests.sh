#!/usr/bin/env bash
# The verl suite: build .venv-verl (verl 0.9.1 on the local torch 2.13.0 CPU wheel, plus
# uvicorn and fastapi, which verl's import chain needs), install memsem into it, run
# tests/verl. Called by `make test-verl`.
#
# Env: VERL_VENV (default .venv-verl), PY (default python3.11), CI (set: the namespace test may not skip).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
V=${VERL_VENV:-$ROOT/.venv-verl}
PY=${PY:-python3.11}
STAMP="$V/.verl-installed"
C="$ROOT/tests/constraints-verl.txt"  # the tested versions (torch: the local 2.13.0 CPU wheel)
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ] || [ "$0" -nt "$STAMP" ] || [ "$C" -nt "$STAMP" ]; then
    [ -x "$V/bin/python" ] || "$PY" -m venv "$V"
    "$V/bin/pip" install -q --upgrade pip setuptools wheel cffi
    # torch first, pinned, so no later resolution pulls another build (GBs of CUDA)
    "$V/bin/pip" install -q -c "$C" torch==2.13.0
    "$V/bin/pip" install -q -c "$C" verl==0.9.1 uvicorn fastapi pytest pytest-asyncio pytest-timeout
    "$V/bin/pip" install -q -c "$C" -e "$ROOT[redis]"
    touch "$STAMP"
fi
export RAY_USAGE_STATS_ENABLED=0
# the two-namespace-node test needs root; under CI a machine that cannot make namespaces fails it
export MEMSEM_REQUIRE_NETNS=${MEMSEM_REQUIRE_NETNS:-${CI:+1}}
export RAY_worker_niceness=${RAY_worker_niceness:-0}
# Ray waits 30 s for its GCS server to write its port, then gives up; on a loaded 2-core machine
# (CI beside two busy loops) the GCS took longer and every cluster of tests/ray failed to start.
# 120 s is Ray's own wait for its slower (rocksdb) backend; a bound still, not a hope.
export RAY_gcs_server_port_wait_time_s=${RAY_gcs_server_port_wait_time_s:-120}
cd "$ROOT"
exec "$V/bin/python" -m pytest -q -p no:cacheprovider -o asyncio_default_fixture_loop_scope=function \
    --timeout 900 tests/verl
