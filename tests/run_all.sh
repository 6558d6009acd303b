#!/usr/bin/env bash
# The test command: run every suite, whatever happened to the ones before, then print one summary
# table (suite, exit status, duration, the suite's own summary lines) and check that the run left
# nothing behind. Exits non-zero if any suite failed or anything was left behind.
#
#   tests/run_all.sh SUITE...        (make test: tests/run_all.sh $(SUITES))
#
# A suite NAME runs `$(MAKE) test-NAME` (so each suite keeps its recipe in the Makefile; adding
# a suite = a test-NAME target plus its name in SUITES). Each suite's output streams to the
# terminal and to a log; the summary lines are the pytest-style totals found in that log.
#
# Leftover check (tests/leftovers.py): memsem segments, job folders and test segment folders in
# the segment directory, mounts under the run's temporary directory (or named memsem),
# and network namespaces named memsem-*, that appeared during the run and do not belong to a
# process outside this run. The run gets a temporary directory of its own (TMPDIR), removed at
# the end unless something is still mounted in it.
#
# Env: PY (python for the checker, default python3), MAKE (default make), RUN_ALL_KEEP_LOGS=1.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PY:-python3}
MAKE=${MAKE:-make}
[ $# -gt 0 ] || { echo "usage: tests/run_all.sh SUITE..." >&2; exit 2; }

RUN_TMP=$(mktemp -d /tmp/memsem-run.XXXXXX)
LOGS="$RUN_TMP/logs"
mkdir -p "$LOGS" "$RUN_TMP/tmp"
SNAP="$RUN_TMP/before.json"
"$PY" "$ROOT/tests/leftovers.py" snapshot "$SNAP" || { echo "run_all: leftover snapshot failed" >&2; exit 2; }

export TMPDIR="$RUN_TMP/tmp"
declare -a NAMES RCS SECS
failed=0
for suite in "$@"; do
    echo
    echo "================================ suite $suite ================================"
    t0=$(date +%s.%N)
    # pipefail: the suite's status, not tee's. No `set -e`: a failing suite never stops the run.
    # shellcheck disable=SC2086  # MAKE may carry arguments
    (cd "$ROOT" && $MAKE --no-print-directory "test-$suite") 2>&1 | tee "$LOGS/$suite.log"
    rc=${PIPESTATUS[0]}
    t1=$(date +%s.%N)
    NAMES+=("$suite")
    RCS+=("$rc")
    SECS+=("$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')")
    [ "$rc" = 0 ] || failed=1
done
unset TMPDIR

echo
echo "================================ leftovers ================================"
"$PY" "$ROOT/tests/leftovers.py" check "$SNAP" --tmp "$RUN_TMP"
left_rc=$?
[ "$left_rc" = 0 ] || failed=1

echo
echo "================================ summary ================================"
printf '%-10s %4s %9s  %s\n' suite rc seconds "summary"
for i in "${!NAMES[@]}"; do
    s=${NAMES[$i]}
    # pytest totals ("== 12 passed, 1 skipped in 3.4s ==") and the suites' own result lines
    lines=$(grep -aE '(^|[= ])[0-9]+ (passed|failed|errors?|skipped|xfailed|xpassed|deselected)|no tests ran|memsem-rdma: .*pytest exit' \
            "$LOGS/$s.log" | sed -E 's/\x1b\[[0-9;]*m//g; s/^=+ //; s/ =+$//' | tail -n 4)
    [ -n "$lines" ] || lines="(no summary line in its output)"
    first=1
    while IFS= read -r line; do
        if [ $first = 1 ]; then
            printf '%-10s %4s %9s  %s\n' "$s" "${RCS[$i]}" "${SECS[$i]}" "$line"
            first=0
        else
            printf '%-10s %4s %9s  %s\n' "" "" "" "$line"
        fi
    done <<< "$lines"
done
printf '%-10s %4s %9s  %s\n' leftovers "$left_rc" "-" "$([ "$left_rc" = 0 ] && echo "nothing left behind" || echo "see the list above")"

if grep -qs . /proc/self/mounts && awk -v d="$RUN_TMP" '$2 == d || index($2, d "/") == 1 { found = 1 } END { exit !found }' /proc/self/mounts; then
    echo "run_all: keeping $RUN_TMP (something is still mounted in it)" >&2
elif [ "${RUN_ALL_KEEP_LOGS:-0}" = 1 ]; then
    echo "run_all: logs kept in $LOGS" >&2
else
    rm -rf "$RUN_TMP"
fi
if [ "$failed" != 0 ]; then
    echo "run_all: FAILED" >&2
    exit 1
fi
echo "run_all: every suite passed and nothing was left behind"
