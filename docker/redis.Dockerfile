# Redis for the compose stack, from Debian's package (no image registry needed). On a host that can
# pull images, `redis:7` works the same with the command in docker-compose.yml.
ARG BASE_IMAGE=rlfleet/base:bookworm
FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update -q \
 && apt-get install -y -q --no-install-recommends redis-server redis-tools \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /var/lib/redis && chown redis:redis /var/lib/redis
COPY docker/redis-entry.sh /usr/local/bin/rlfleet-redis
USER redis
WORKDIR /var/lib/redis
VOLUME /var/lib/redis
# AOF on, fsync every second, never evict (streams must not lose entries), password from $REDIS_PASSWORD.
ENTRYPOINT ["sh", "/usr/local/bin/rlfleet-redis"]
HEALTHCHECK --interval=2s --timeout=3s --start-period=30s --retries=5 \
  CMD sh -c 'REDISCLI_AUTH="$REDIS_PASSWORD" redis-cli -h "${RLFLEET_REDIS_BIND:-127.0.0.1}" -p "${RLFLEET_REDIS_PORT:-6379}" ping | grep -q PONG'
