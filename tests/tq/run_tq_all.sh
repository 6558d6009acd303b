#!/usr/bin/env bash
# Everything TransferQueue: build the TQ venv, run memsem's TQ backend tests, memsem's Ray
# directory on a Ray cluster of three nodes made on this machine (tests/ray: the venv has Ray),
# TQ's own backend-neutral e2e files (unmodified, from the installed wheel) against Memsem on such
# a cluster with no Redis (tests/ray/run_tq_cluster.py) and across two network-namespace nodes
# with Redis (tests/tq/run_tq_nodes.py; skipped, saying why, where namespaces cannot be made), and
# the SimpleStorage vs Memsem comparison. Called by `make test-tq`.
#
# Env: TQ_VENV (default .venv-tq), PY (default python3.11), TQ_BENCH=0 skips the comparison,
#      TQ_BENCH_ARGS (extra bench_tq.py args, e.g. "--seq-len 32768").
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE="$ROOT/tests/tq"
V=${TQ_VENV:-$ROOT/.venv-tq}
PY=${PY:-python3.11}
STAMP="$V/.tq-installed"
C="$ROOT/tests/constraints.txt"  # the tested versions (torch: the local 2.13.0 CPU wheel)

if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ] || [ "$HERE/requirements-tq.txt" -nt "$STAMP" ] || [ "$C" -nt "$STAMP" ]; then
    [ -x "$V/bin/python" ] || "$PY" -m venv "$V"
    "$V/bin/pip" install -q --upgrade pip setuptools wheel cffi
    # torch first, pinned, so no later resolution pulls another build (GBs of CUDA).
    "$V/bin/pip" install -q -c "$C" torch==2.13.0
    "$V/bin/pip" install -q -c "$C" -r "$HERE/requirements-tq.txt"
    "$V/bin/pip" install -q -c "$C" -e "$ROOT[transferqueue,redis]"  # redis: the cross-node run (run_tq_nodes.py)
    touch "$STAMP"
fi

export RAY_OVERRIDE_RESOURCES=${RAY_OVERRIDE_RESOURCES:-'{"CPU": 8}'}  # 2-core CI boxes
export RAY_USAGE_STATS_ENABLED=0
# See run_tq_e2e.sh: TQ's per-call thread warning and Ray's token-auth warning, causes fixed.
if [ -z "${TQ_NUM_THREADS:-}" ]; then
    TQ_NUM_THREADS=$("$V/bin/python" -c 'import psutil; print(psutil.cpu_count(logical=False) or 1)')
    export TQ_NUM_THREADS
fi
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
# Ray starts its workers (TQ's controller, actors, tasks) at nice 15 so that its own daemons come
# first; beside CPU-bound processes at nice 0 they then get a few percent of a core and TQ runs
# crawl (measured 5-7x slower with two busy loops; tq.init 20 s instead of 6 s). Run them at the
# priority of everything else.
export RAY_worker_niceness=${RAY_worker_niceness:-0}
# Ray waits 30 s for its GCS server to write its port, then gives up; on a loaded 2-core machine
# (CI beside two busy loops) the GCS took longer and every cluster of tests/ray failed to start.
# 120 s is Ray's own wait for its slower (rocksdb) backend; a bound still, not a hope.
export RAY_gcs_server_port_wait_time_s=${RAY_gcs_server_port_wait_time_s:-120}

echo "== memsem TQ backend tests"
# pytest-asyncio (a TQ test dependency) warns unless its fixture loop scope is set.
(cd "$ROOT" && "$V/bin/python" -m pytest -q -p no:cacheprovider -o asyncio_default_fixture_loop_scope=function \
    tests/test_tq_backend.py)

echo "== memsem's ray directory on a three-node Ray cluster (tests/ray; no Redis)"
# The cluster is the tests' own (tests/ray/cluster.py: a private RAY_TMPDIR, removed at the end);
# nothing of this script's Ray settings for TQ applies to it.
(cd "$ROOT" && env -u RAY_OVERRIDE_RESOURCES -u RAY_ADDRESS "$V/bin/python" -m pytest -q -p no:cacheprovider \
    -o asyncio_default_fixture_loop_scope=function tests/ray)

echo "== TransferQueue e2e (unmodified) against Memsem on a three-node Ray cluster (no Redis: the Ray job's directory)"
# The cluster (tests/ray/run_tq_cluster.py): the test driver and the storage agent on the head,
# TQ's controller on a worker node; first TQ's own API across nodes (a batch put on one worker
# node, read bit-exact on the other, both over tcp), then TQ's e2e files with their driver
# joining the cluster. (It replaces the run on a cluster of the e2e files' own: the same files,
# the same routes for the driver, one cluster start less.)
(cd "$ROOT" && env -u RAY_OVERRIDE_RESOURCES -u RAY_ADDRESS "$V/bin/python" "$ROOT/tests/ray/run_tq_cluster.py" "$V")

echo "== TransferQueue e2e (unmodified) across two namespace nodes: agent on one, clients on the other (tcp)"
"$V/bin/python" "$HERE/run_tq_nodes.py" "$V"

if [ "${TQ_BENCH:-1}" != 0 ]; then
    echo "== SimpleStorage vs Memsem, same workload"
    OUT=$(mktemp -d /tmp/tq-bench.XXXXXX)
    trap 'rm -rf "$OUT"' EXIT
    # shellcheck disable=SC2086
    "$V/bin/python" "$HERE/bench_tq.py" --backend SimpleStorage --json "$OUT/simple.json" ${TQ_BENCH_ARGS:-} >/dev/null
    # shellcheck disable=SC2086
    "$V/bin/python" "$HERE/bench_tq.py" --backend Memsem --backend-module memsem.integrations.transferqueue \
        --extra-stats memsem.integrations.transferqueue:counters --json "$OUT/memsem.json" ${TQ_BENCH_ARGS:-} >/dev/null
    "$V/bin/python" "$HERE/compare_bench.py" "$OUT/simple.json" "$OUT/memsem.json"
fi
