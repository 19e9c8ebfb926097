#!/usr/bin/env bash
# make test-e2e: the production topology, from nothing, on loopback only.
# Installs what is missing (Debian postgresql, redis-server, chromium + chromium-driver, Java and
# Maven for Kafka, the venvs' e2e extras, the Celery venv, Kafka's jars),
# runs the pytest suite (which starts and stops every server), and whatever happened
# kills every process group the run started and checks nothing is left listening.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
AF=$REPO/.venv-airflow
PF=$REPO/.venv-prefect
START=$(date +%s)

# shellcheck source=../scripts/apt-need.sh
. "$REPO/scripts/apt-need.sh"
need_apt=()
compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null || need_apt+=(postgresql)
command -v redis-server >/dev/null || need_apt+=(redis-server)
# The UI checks drive Debian's headless Chromium (no browser download).
[ -x /usr/bin/chromium ] || need_apt+=(chromium)
[ -x /usr/bin/chromedriver ] || need_apt+=(chromium-driver)
[ -d /usr/share/fonts/truetype/liberation ] || need_apt+=(fonts-liberation)  # text in the screenshots
need_kafka_tools
apt_install_missing e2e

# The queue extra: the Airflow workers' PandaStackQueueOperator consumes Kafka (confluent-kafka).
if [ ! -f "$AF/.e2e-installed" ] || [ pyproject.toml -nt "$AF/.e2e-installed" ] ||
  ! "$AF/bin/python" -c 'import confluent_kafka' 2>/dev/null; then
  echo "e2e: installing the e2e and queue extras into $AF"
  "$AF/bin/pip" install -q --disable-pip-version-check -e '.[airflow,local,test,e2e,queue]'
  touch "$AF/.e2e-installed"
fi
# The sandbox Celery task runs on a worker of the Celery venv (its own Celery, not Airflow's pin).
make -s .venv-celery/.installed
tests/queue/kafka/jars.sh >/dev/null  # Kafka's jars, fetched once and cached
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

# shellcheck source=../scripts/run-dir.sh
. "$REPO/scripts/run-dir.sh"
cleanup() {
  rc=$?
  trap - EXIT INT TERM
  if ! reap_run_dir e2e "$AF/bin/python" "$RUN_DIR" "$RUN_DIR/pgids" 2 && [ "$rc" = 0 ]; then
    rc=1
  fi
  echo "e2e: wall time $(( $(date +%s) - START ))s, exit $rc"
  exit "$rc"
}
trap cleanup EXIT INT TERM

"$AF/bin/python" -m pytest -p no:cacheprovider -o testpaths=e2e -c /dev/null --rootdir "$REPO" \
  -q -rA --timeout 900 e2e "$@"
