#!/usr/bin/env bash
# make test-observability: the metrics and traces of issue 38 (docs/observability.md), from
# nothing: installs Debian's prometheus, redis-server, a Java 17 runtime and Maven (apt) and the
# venvs' extras when missing, then runs tests/observability (real server, real consumer, real Redis
# and Kafka, real prometheus, each on loopback and free ports, stopped by the tests) and the
# engines' trace tests in their venvs.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
AF=${AF:-$REPO/.venv-airflow}
PF=${PF:-$REPO/.venv-prefect}

# shellcheck source=../../scripts/apt-need.sh
. "$REPO/scripts/apt-need.sh"
need_apt=()
[ -x /usr/bin/prometheus ] || need_apt+=(prometheus)
command -v redis-server >/dev/null || need_apt+=(redis-server)
need_kafka_tools
apt_install_missing test-observability
"$AF/bin/python" -c 'import prometheus_client, opentelemetry.sdk, redis, confluent_kafka' 2>/dev/null ||
  "$AF/bin/pip" install -q --disable-pip-version-check -e '.[airflow,local,queue,test,otel]'
"$PF/bin/python" -c 'import prometheus_client, opentelemetry.sdk' 2>/dev/null ||
  "$PF/bin/pip" install -q --disable-pip-version-check -e '.[prefect,local,queue,test,otel]'
tests/queue/kafka/jars.sh >/dev/null  # Kafka's jars, fetched once and cached

"$AF/bin/python" -m pytest -p no:cacheprovider -q tests/observability tests/airflow/test_airflow_traces.py \
  tests/unit/core/test_observability.py "$@"
"$PF/bin/python" -m pytest -p no:cacheprovider -q tests/prefect/test_prefect_traces.py "$@"
