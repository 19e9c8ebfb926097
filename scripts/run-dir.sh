# Sourced by e2e/run.sh, tests/queue/run.sh and tests/celery_tasks/run.sh: the end of a run that
# started servers and brokers.
# Their fixtures note each process group they start ("PGID NAME" lines in a pgids file) and each
# port they listen on ($RUN_DIR/ports); every process they start carries E2E_RUN_DIR=$RUN_DIR.

# reap_run_dir LABEL PYTHON RUN_DIR PGIDS GRACE: TERM every process group still alive in PGIDS,
# KILL them GRACE seconds later, then check that no process of the run is left and none of its
# ports is still listening. Returns 1 (and says so) when something is left.
reap_run_dir() {
  local label=$1 python=$2 run_dir=$3 pgids=$4 grace=$5 pgid name left
  if [ -f "$pgids" ]; then
    while read -r pgid name; do
      if kill -0 -- "-$pgid" 2>/dev/null; then
        echo "$label: cleanup: killing leftover process group $pgid ($name)"
        kill -TERM -- "-$pgid" 2>/dev/null || true
      fi
    done <"$pgids"
    sleep "$grace"
    while read -r pgid _; do kill -KILL -- "-$pgid" 2>/dev/null || true; done <"$pgids"
  fi
  left=$("$python" - "$run_dir" <<'PY'
import os, sys
from pandastack_local.testing.procs import listening_ports, pids, read_proc
run_dir = sys.argv[1]
try:
    ours = {int(p) for p in open(os.path.join(run_dir, "ports")).read().split()}
except OSError:
    ours = set()
procs = [
    str(pid)
    for pid in pids()
    if f"E2E_RUN_DIR={run_dir}".encode() in (read_proc(pid, "environ") or b"")
    or run_dir.encode() in (read_proc(pid, "cmdline") or b"")
]
procs = [p for p in procs if int(p) != os.getppid()]  # the shell running this check
ports = sorted(listening_ports() & ours)
print(f"procs={' '.join(procs)} ports={' '.join(map(str, ports))}")
PY
) || left="check failed"
  echo "$label: after cleanup: $left"
  if [ "$left" != "procs= ports=" ]; then
    echo "$label: FAIL: processes or listening ports left behind"
    return 1
  fi
}

# open_run_dir LABEL PYTHON WHAT: a fresh RUN_DIR (/tmp/pandastack-LABEL-without-test-.XXXXXX, mode
# 755: the brokers run as their own users) exported as E2E_RUN_DIR and QUEUE_RUN_DIR for the
# fixtures, and an EXIT/INT/TERM trap that reaps it with reap_run_dir over every */pgids in it,
# removes it when nothing was left (else fails the run), and says the wall time since $START.
# WHAT says what the directory holds.
open_run_dir() {
  RUN_LABEL=$1 RUN_PYTHON=$2
  RUN_DIR=$(mktemp -d "/tmp/pandastack-${1#test-}.XXXXXX")
  chmod 755 "$RUN_DIR"
  export E2E_RUN_DIR=$RUN_DIR QUEUE_RUN_DIR=$RUN_DIR
  echo "$1: run directory ($3) $RUN_DIR"
  trap close_run_dir EXIT INT TERM
}

close_run_dir() {
  local rc=$?
  trap - EXIT INT TERM
  cat "$RUN_DIR"/*/pgids 2>/dev/null >"$RUN_DIR/all-pgids" || true
  if reap_run_dir "$RUN_LABEL" "$RUN_PYTHON" "$RUN_DIR" "$RUN_DIR/all-pgids" 1; then
    rm -rf "$RUN_DIR"
  elif [ "$rc" = 0 ]; then
    rc=1
  fi
  echo "$RUN_LABEL: wall time $(($(date +%s) - START))s, exit $rc"
  exit "$rc"
}
