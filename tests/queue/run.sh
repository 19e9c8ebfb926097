#!/usr/bin/env bash
# make test-queue: the queue consumer on real brokers, from nothing, on loopback only.
# Installs what is missing (Debian redis-server, postgresql, rabbitmq-server, a Java 17 runtime
# and Maven; the venv's queue extra; Apache Kafka's jars, once, into a cache: tests/queue/kafka/),
# runs tests/queue (whose fixtures start each broker on free ports, as e2e/ does, and
# stop them), and whatever happened kills every process group the run started and checks that
# nothing is left running or listening.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
AF=${AF:-$REPO/.venv-airflow}
PF=${PF:-$REPO/.venv-prefect}
START=$(date +%s)

# shellcheck source=../../scripts/apt-need.sh
. "$REPO/scripts/apt-need.sh"
need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null || need_apt+=(postgresql)
[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || need_apt+=(rabbitmq-server)
need_kafka_tools
apt_install_missing test-queue
if ! "$AF/bin/python" -c 'import redis, psycopg, pika, boto3, moto.server, hypothesis, confluent_kafka' 2>/dev/null; then
  echo "test-queue: installing the queue extra into $AF"
  "$AF/bin/pip" install -q --disable-pip-version-check -e '.[airflow,local,test,queue]'
fi
if ! "$PF/bin/python" -c 'import redis, psycopg, pika, boto3, moto.server, hypothesis, confluent_kafka' 2>/dev/null; then
  echo "test-queue: installing the queue extra into $PF"
  "$PF/bin/pip" install -q --disable-pip-version-check -e '.[prefect,local,test,queue]'
fi
# Kafka's jars before the two test processes start (each would otherwise wait on the other's fetch).
kafka_start=$(date +%s)
tests/queue/kafka/jars.sh >/dev/null
echo "test-queue: Kafka's jars ready in $(( $(date +%s) - kafka_start ))s"

# shellcheck source=../../scripts/run-dir.sh
. "$REPO/scripts/run-dir.sh"
# RUN_DIR, reaped and checked on the way out whatever happened.
open_run_dir test-queue "$AF/bin/python" "broker logs and data"

# The core and the Airflow operator in the Airflow venv, the Prefect flow in the Prefect venv
# (each pytest process starts its own brokers), side by side.
"$AF/bin/python" -m pytest -p no:cacheprovider -q -rfE tests/queue --ignore=tests/queue/prefect \
  tests/unit/core/test_queue_message.py "$@" &
af=$!
"$PF/bin/python" -m pytest -p no:cacheprovider -q -rfE tests/queue/prefect "$@" \
  >"$RUN_DIR/prefect-pytest.log" 2>&1 &
pf=$!
rc=0
wait "$af" || rc=$?
wait "$pf" || rc=$?
echo "test-queue: the Prefect venv's run:"
cat "$RUN_DIR/prefect-pytest.log"
exit "$rc"
