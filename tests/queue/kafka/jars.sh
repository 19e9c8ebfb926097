#!/usr/bin/env bash
# Prints the directory holding Apache Kafka's jars (tests/queue/kafka/pom.xml), resolving them
# with Maven the first time: the directory is keyed by the pom's hash, so a changed pom fetches
# anew and an unchanged one is reused across runs. Maven's own cache (~/.m2) makes a re-fetch cheap.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
sum=$(sha256sum "$here/pom.xml" | cut -c1-16)
dir="${PANDASTACK_KAFKA_JARS:-${XDG_CACHE_HOME:-$HOME/.cache}/pandastack-kafka}/$sum"
if [ ! -e "$dir/.complete" ]; then
  mkdir -p "$dir"
  exec 9>"$dir.lock"
  flock 9  # two test processes may ask at once: one fetches, the other waits and reuses
  if [ ! -e "$dir/.complete" ]; then
    start=$(date +%s.%N)
    mvn -q -B -f "$here/pom.xml" dependency:copy-dependencies \
      -DoutputDirectory="$dir" -DincludeScope=runtime >"$dir.log" 2>&1 \
      || { cat "$dir.log" >&2; echo "kafka jars: mvn failed (log above)" >&2; exit 1; }
    touch "$dir/.complete"
    echo "kafka jars: fetched into $dir in $(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN{printf "%.1f", e-s}')s" >&2
  fi
fi
echo "$dir"
