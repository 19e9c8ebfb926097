#!/usr/bin/env bash
# Get a working gVisor runsc for pandastack-local's --isolation gvisor (docs/local-server.md).
#
# bookworm's own runsc (2022) breaks `ls` on every directory; bookworm-backports has a
# working one (>= 0.0~20240729). The backports source is derived from this machine's own
# Debian source entry (deb822 debian.sources or sources.list), written to a temporary
# list, used for this one install and removed again: no registry host is named here.
# Idempotent: exits at once when a good runsc is installed and runs a container
# (RUNSC_REINSTALL=1 goes through the install anyway).
set -euo pipefail

MIN_VERSION="0.0~20240729"
RUNSC="${RUNSC:-runsc}"

log() { echo "install-runsc: $*" >&2; }

version_ok() {
    local v
    v=$(dpkg-query -W -f='${Version}' runsc 2>/dev/null) || return 1
    dpkg --compare-versions "$v" ge "$MIN_VERSION"
}

# Run `true` in a throwaway container: the proof that runsc works on this machine (systrap).
smoke() {
    local dir rc=0
    dir=$(mktemp -d /tmp/runsc-smoke.XXXXXX)
    mkdir -p "$dir/rootfs"
    cat >"$dir/config.json" <<JSON
{"ociVersion":"1.0.0","process":{"args":["/bin/sh","-c","ls / >/dev/null && true"],"cwd":"/","user":{"uid":0,"gid":0},
 "env":["PATH=/usr/bin:/bin"]},
 "root":{"path":"rootfs","readonly":true},
 "mounts":[{"destination":"/usr","type":"bind","source":"/usr","options":["rbind","ro"]},
  {"destination":"/bin","type":"bind","source":"/bin","options":["rbind","ro"]},
  {"destination":"/lib","type":"bind","source":"/lib","options":["rbind","ro"]},
  {"destination":"/lib64","type":"bind","source":"/lib64","options":["rbind","ro"]},
  {"destination":"/proc","type":"proc","source":"proc"}],
 "linux":{"namespaces":[{"type":"pid"},{"type":"mount"},{"type":"ipc"},{"type":"uts"},{"type":"network"}]}}
JSON
    timeout 60 "$RUNSC" --root "$dir/state" --network=none --platform=systrap \
        run --bundle "$dir" "smoke-$$" >"$dir/out" 2>&1 || rc=$?
    if [ "$rc" != 0 ]; then
        log "runsc did not run a container (exit $rc):"
        sed 's/^/  /' "$dir/out" >&2
    fi
    "$RUNSC" --root "$dir/state" delete -force "smoke-$$" >/dev/null 2>&1 || true
    rm -rf "$dir"
    return "$rc"
}

if [ -z "${RUNSC_REINSTALL:-}" ] && version_ok && command -v "$RUNSC" >/dev/null && smoke; then
    log "runsc $(dpkg-query -W -f='${Version}' runsc) is installed and runs containers"
    exit 0
fi

if [ "$(id -u)" != 0 ]; then
    log "needs root to install runsc: sudo $0 (or: sudo apt-get install -t bookworm-backports runsc)"
    exit 1
fi

# The URI and keyring of this machine's Debian archive entry (the one listing bookworm).
uri="" keyring=""
if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    stanza=$(awk -v RS= '/Suites:.*[[:space:]]bookworm([[:space:]]|$)/ {print; exit}' \
        /etc/apt/sources.list.d/debian.sources)
    uri=$(printf '%s\n' "$stanza" | awk '/^URIs:/ {print $2; exit}')
    keyring=$(printf '%s\n' "$stanza" | awk '/^Signed-By:/ {print $2; exit}')
fi
if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
    uri=$(awk '$1 == "deb" && $0 ~ / bookworm / {for (i = 2; i <= NF; i++) if ($i ~ /:\/\//) {print $i; exit}}' \
        /etc/apt/sources.list)
fi
if [ -z "$uri" ]; then
    log "no Debian bookworm source entry found in /etc/apt (this script supports Debian 12):"
    log "install runsc >= $MIN_VERSION by hand and pass --runsc PATH"
    exit 1
fi

list=/etc/apt/sources.list.d/pandastack-bookworm-backports.sources
trap 'rm -f "$list"' EXIT
{
    echo "Types: deb"
    echo "URIs: $uri"
    echo "Suites: bookworm-backports"
    echo "Components: main"
    [ -n "$keyring" ] && echo "Signed-By: $keyring"
} >"$list"
log "installing runsc from bookworm-backports (source derived from $uri)"
# Every list, not only backports': a fresh machine may never have run `apt-get update`.
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -t bookworm-backports runsc >/dev/null
rm -f "$list"
trap - EXIT

if ! version_ok; then
    log "installed runsc $(dpkg-query -W -f='${Version}' runsc 2>/dev/null || echo none) is older than $MIN_VERSION"
    exit 1
fi
smoke
log "runsc $(dpkg-query -W -f='${Version}' runsc) installed and runs containers (systrap)"
