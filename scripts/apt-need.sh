# Sourced by the run scripts that start their own servers and brokers (e2e/run.sh,
# tests/queue/run.sh, tests/celery_tasks/run.sh, tests/observability/run.sh): each lists what it
# lacks in the array need_apt, then installs it all with one apt run. The packages' own services
# do not start here (no systemd; policy-rc.d): the tests start their own, on free loopback ports.

# need_kafka_tools: Apache Kafka's jars are resolved with Maven (tests/queue/kafka/jars.sh) and run
# on Java 17.
need_kafka_tools() {
  command -v java >/dev/null || need_apt+=(openjdk-17-jre-headless)
  command -v mvn >/dev/null || need_apt+=(maven)
}

# apt_install_missing LABEL: install what need_apt holds, if anything, saying so.
apt_install_missing() {
  ((${#need_apt[@]})) || return 0
  echo "$1: installing ${need_apt[*]} (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends "${need_apt[@]}" >/dev/null
}
