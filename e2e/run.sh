#!/usr/bin/env bash
# make test-e2e: the production topology, from nothing, on loopback only.
# Installs what is missing (Debian postgresql, redis-server, chromium + chromium-driver, the
# venvs' e2e extras),
# runs the pytest suite (which starts and stops every server), and whatever happened
# kills every process group the run started and checks nothing is left listening.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
AF=$REPO/.venv-airflow
PF=$REPO/.venv-prefect
START=$(date +%s)

need_apt=()
compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null || need_apt+=(postgresql)
command -v redis-server >/dev/null || need_apt+=(redis-server)
# The UI checks drive Debian's headless Chromium (no browser download).
[ -x /usr/bin/chromium ] || need_apt+=(chromium)
[ -x /usr/bin/chromedriver ] || need_apt+=(chromium-driver)
[ -d /usr/share/fonts/truetype/liberation ] || need_apt+=(fonts-liberation)  # text in the screenshots
if ((${#need_apt[@]})); then
  echo "e2e: installing ${need_apt[*]} (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends "${need_apt[@]}" >/dev/null
fi

if [ ! -f "$AF/.e2e-installed" ] || [ pyproject.toml -nt "$AF/.e2e-installed" ]; then
  echo "e2e: installing the e2e extra into $AF"
  "$AF/bin/pip" install -q --disable-pip-version-check -e '.[airflow,local,test,e2e]'
  touch "$AF/.e2e-installed"
fi
# Prefect talks to PostgreSQL through asyncpg, which prefect already depends on.
"$PF/bin/python" -c 'import asyncpg, prefect_blocks' >/dev/null
# The queue tests' Prefect deployment consumes Redis (redis-py, the queue extra); the Airflow venv
# has redis-py from celery[redis].
if ! "$PF/bin/python" -c 'import redis' 2>/dev/null; then
  echo "e2e: installing the queue extra into $PF"
  "$PF/bin/pip" install -q --disable-pip-version-check -e '.[prefect,local,test,queue]'
fi

RUN_DIR=$(mktemp -d /tmp/pandastack-e2e.XXXXXX)
chmod 755 "$RUN_DIR"
export E2E_RUN_DIR=$RUN_DIR
echo "e2e: run directory (logs, state) $RUN_DIR"

cleanup() {
  rc=$?
  trap - EXIT INT TERM
  if [ -f "$RUN_DIR/pgids" ]; then
    while read -r pgid name; do
      if kill -0 -- "-$pgid" 2>/dev/null; then
        echo "e2e: cleanup: killing leftover process group $pgid ($name)"
        kill -TERM -- "-$pgid" 2>/dev/null || true
      fi
    done <"$RUN_DIR/pgids"
    sleep 2
    while read -r pgid name; do
      kill -KILL -- "-$pgid" 2>/dev/null || true
    done <"$RUN_DIR/pgids"
  fi
  left=$("$AF/bin/python" - "$RUN_DIR" <<'PY'
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
ports = sorted(listening_ports() & ours)
print(f"procs={' '.join(procs)} ports={' '.join(map(str, ports))}")
PY
) || left="check failed"
  echo "e2e: after cleanup: $left"
  case "$left" in
    "procs= ports=") ;;
    *) echo "e2e: FAIL: processes or listening ports left behind"; [ "$rc" = 0 ] && rc=1 ;;
  esac
  echo "e2e: wall time $(( $(date +%s) - START ))s, exit $rc"
  exit "$rc"
}
trap cleanup EXIT INT TERM

"$AF/bin/python" -m pytest -p no:cacheprovider -o testpaths=e2e -c /dev/null --rootdir "$REPO" \
  -q -rA --timeout 900 e2e "$@"
