#!/usr/bin/env bash
# The Debian packages the integration legs start their own services from (brokers, Prometheus, Java
# and Maven for Kafka, Chromium for e2e's screenshots, node for the base template, runsc), in one
# apt run before .ci/run starts its lanes: each leg's own script installs what it misses too, but
# legs side by side would otherwise race for dpkg's lock on a fresh machine. Fast when all are there.
set -euo pipefail
need=()
command -v redis-server >/dev/null || need+=(redis-server)
compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null || need+=(postgresql)
[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || need+=(rabbitmq-server)
[ -x /usr/bin/prometheus ] || need+=(prometheus)
command -v java >/dev/null || need+=(openjdk-17-jre-headless)
command -v mvn >/dev/null || need+=(maven)
command -v node >/dev/null || need+=(nodejs)
[ -x /usr/bin/chromium ] || need+=(chromium)
[ -x /usr/bin/chromedriver ] || need+=(chromium-driver)
[ -d /usr/share/fonts/truetype/liberation ] || need+=(fonts-liberation)
if ((${#need[@]})); then
  if [ "$(id -u)" != 0 ]; then
    echo "install-services: missing ${need[*]}: sudo apt-get install ${need[*]}" >&2
    exit 1
  fi
  echo "install-services: installing ${need[*]} (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  # Their own services do not start here (no systemd; policy-rc.d): each leg starts its own.
  apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
fi
bash "$(dirname "$0")/install-runsc.sh"
