#!/usr/bin/env bash
# make test-celery: sandbox tasks on a real celery worker, real Redis and RabbitMQ, from nothing,
# on loopback only. Installs what is missing (Debian redis-server and rabbitmq-server), runs
# tests/celery_tasks (whose fixtures start the brokers, the result backend and the workers on free
# ports, and stop them), and whatever happened kills every process group the run started and
# checks that nothing is left running or listening.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
CE=${CE:-$REPO/.venv-celery}
START=$(date +%s)

# shellcheck source=../../scripts/apt-need.sh
. "$REPO/scripts/apt-need.sh"
need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || need_apt+=(rabbitmq-server)
apt_install_missing test-celery

# shellcheck source=../../scripts/run-dir.sh
. "$REPO/scripts/run-dir.sh"
# RUN_DIR, reaped and checked on the way out whatever happened.
open_run_dir test-celery "$CE/bin/python" "broker and worker logs"

"$CE/bin/python" -m pytest -p no:cacheprovider -q -rfE tests/celery_tasks "$@"
