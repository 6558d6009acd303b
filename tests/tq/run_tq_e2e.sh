#!/usr/bin/env bash
# Run TransferQueue's backend-neutral e2e files and its checkpoint e2e file, unmodified, from
# the installed wheel, against one storage backend (conftest_plugin.py points them at it), plus
# this harness's own Memsem checkpoint/restart e2e file when the backend is Memsem.
#
#   tests/tq/run_tq_e2e.sh VENV BACKEND [extra pytest args...]
#
# VENV     a virtualenv with transferqueue==0.1.11 (+ torch, ray, tensordict, pytest)
# BACKEND  a name TQ_TEST_BACKEND accepts: SimpleStorage (TQ's default), or one that the
#          plugin adds, e.g. Probe (tests/tq/probe_backend.py). Extra backend modules are
#          named in TQ_EXTRA_BACKEND_MODULES (default probe_backend); they must be
#          importable from PYTHONPATH or installed in VENV.
#
# Env: TQ_E2E_TIMEOUT (seconds, default 900). Exit status: pytest's (124 on timeout).
set -u
if [ $# -lt 2 ]; then
    echo "usage: $0 VENV BACKEND [pytest args...]" >&2
    exit 2
fi
VENV=$1
BACKEND=$2
shift 2
HERE=$(cd "$(dirname "$0")" && pwd)
PY="$VENV/bin/python"

# Locate the wheel's tests by asking the venv where transfer_queue lives; the wheel
# installs them as a top-level namespace package 'tests' beside it.
SITE=$("$PY" -c 'import os, transfer_queue; print(os.path.dirname(os.path.dirname(transfer_queue.__file__)))') || exit 2
E2E="$SITE/tests/e2e"
FILES=("$E2E/test_e2e_lifecycle_consistency.py" "$E2E/test_kv_interface_e2e.py" "$E2E/test_checkpoint_e2e.py")
for f in "${FILES[@]}"; do
    [ -f "$f" ] || { echo "missing $f (is transferqueue==0.1.11 installed in $VENV?)" >&2; exit 2; }
done

# Run from a scratch dir with an empty ini file so neither this repo's tests/ package nor
# its pytest settings (pyproject/pytest.ini) apply to TQ's files.
WORK=$(mktemp -d /tmp/tq-e2e.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
printf '[pytest]\nasyncio_default_fixture_loop_scope = function\n' > "$WORK/pytest.ini"
if [ "$BACKEND" = Memsem ]; then FILES+=("$HERE/e2e_memsem_checkpoint.py"); fi

export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
export TQ_TEST_BACKEND="$BACKEND"
# On a 2-core machine Ray offers 2 CPUs and tq.init() waits forever for its actors.
if [ -z "${RAY_OVERRIDE_RESOURCES:-}" ]; then export RAY_OVERRIDE_RESOURCES='{"CPU": 8}'; fi
export RAY_DEDUP_LOGS=0
# Ray's usage-stats prompt/upload and dashboard are not needed and cost startup time.
export RAY_USAGE_STATS_ENABLED=0
# Quiet by default, causes fixed rather than messages filtered:
# - TQ limits torch to TQ_NUM_THREADS (default 8) threads per put/get and warns on every call
#   where the machine has fewer physical cores: ask for what the machine has.
# - Ray 2.60 turns token authentication on by default with a warning per ray.init(); say so.
if [ -z "${TQ_NUM_THREADS:-}" ]; then
    TQ_NUM_THREADS=$("$PY" -c 'import psutil; print(psutil.cpu_count(logical=False) or 1)') || TQ_NUM_THREADS=1
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

cd "$WORK" || exit 2
start=$(date +%s.%N)
timeout --kill-after=30 "${TQ_E2E_TIMEOUT:-900}" \
    "$PY" -m pytest -c "$WORK/pytest.ini" --rootdir "$SITE" -p no:cacheprovider \
    -p conftest_plugin -q -rs "${FILES[@]}" "$@"
rc=$?
end=$(date +%s.%N)
echo "run_tq_e2e: backend=$BACKEND rc=$rc wall=$(awk "BEGIN{printf \"%.1fs\", $end-$start}")"
exit $rc
