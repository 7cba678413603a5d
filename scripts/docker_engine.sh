#!/usr/bin/env bash
# Make sure a Docker engine answers on this host; start one when none does.
#
#   scripts/docker_engine.sh          exit 0 once `docker info` works (installs docker.io + docker-compose
#                                     from Debian as root when dockerd is missing, then starts dockerd)
#
# The engine started here runs in the background with its log in $RLFLEET_DOCKERD_LOG (default
# /tmp/rlfleet-dockerd.log) and its pid in $RLFLEET_DOCKERD_PID (default /tmp/rlfleet-dockerd.pid);
# stop it with `kill "$(cat /tmp/rlfleet-dockerd.pid)"`. A host with Docker already running is left
# as it is. Exit status 3 means: no engine and none can be started here (the message says why).
set -euo pipefail

LOG="${RLFLEET_DOCKERD_LOG:-/tmp/rlfleet-dockerd.log}"
PIDFILE="${RLFLEET_DOCKERD_PID:-/tmp/rlfleet-dockerd.pid}"
DATA_ROOT="${RLFLEET_DOCKER_DATA_ROOT:-/var/lib/docker}"
WAIT_S="${RLFLEET_DOCKERD_WAIT_S:-60}"

if docker info >/dev/null 2>&1; then
  exit 0
fi

need_apt=()
command -v dockerd >/dev/null 2>&1 || need_apt+=(docker.io)
command -v docker >/dev/null 2>&1 || need_apt+=(docker.io)
if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null 2>&1; then
  need_apt+=(docker-compose)
fi
if [ "${#need_apt[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "docker_engine: installing ${need_apt[*]} from Debian" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q "${need_apt[@]}" >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q "${need_apt[@]}" >/dev/null; } \
      || { echo "docker_engine: cannot install ${need_apt[*]} with apt-get" >&2; exit 3; }
  else
    echo "docker_engine: ${need_apt[*]} missing and this is not root with apt-get" >&2
    exit 3
  fi
fi

if [ "$(id -u)" != 0 ]; then
  echo "docker_engine: no Docker engine answers and starting dockerd needs root" >&2
  exit 3
fi

echo "docker_engine: starting dockerd (data root $DATA_ROOT, log $LOG)" >&2
mkdir -p "$DATA_ROOT"
nohup dockerd --data-root "$DATA_ROOT" >"$LOG" 2>&1 </dev/null &
echo $! >"$PIDFILE"
for _ in $(seq "$WAIT_S"); do
  if docker info >/dev/null 2>&1; then
    echo "docker_engine: dockerd ready (pid $(cat "$PIDFILE"))" >&2
    exit 0
  fi
  if ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    echo "docker_engine: dockerd exited while starting; last lines of $LOG:" >&2
    tail -15 "$LOG" >&2
    exit 3
  fi
  sleep 1
done
echo "docker_engine: dockerd did not answer within ${WAIT_S}s; last lines of $LOG:" >&2
tail -15 "$LOG" >&2
exit 3
