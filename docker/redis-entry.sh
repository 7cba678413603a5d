#!/bin/sh
# Start redis-server the way rlfleet needs it: AOF on, noeviction, password from the environment (written
# to a private config file, so it never shows in `ps`). Extra arguments go to redis-server.
set -eu
: "${REDIS_PASSWORD:?REDIS_PASSWORD must be set}"
conf="$(mktemp /tmp/redis.XXXXXX.conf)"
chmod 600 "$conf"
cat >"$conf" <<EOF
bind ${RLFLEET_REDIS_BIND:-127.0.0.1}
port ${RLFLEET_REDIS_PORT:-6379}
protected-mode yes
dir /var/lib/redis
appendonly yes
appendfsync everysec
maxmemory ${RLFLEET_REDIS_MAXMEMORY:-0}
maxmemory-policy noeviction
save ""
requirepass ${REDIS_PASSWORD}
EOF
exec redis-server "$conf" "$@"
