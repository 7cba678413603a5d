# Prometheus for the compose stack, from Debian's package (no image registry needed). On a host that
# can pull images, `prom/prometheus` works the same with the flags in docker-compose.yml.
ARG BASE_IMAGE=rlfleet/base:bookworm
FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update -q \
 && apt-get install -y -q --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /var/lib/prometheus/data && chown -R prometheus:prometheus /var/lib/prometheus
USER prometheus
VOLUME /var/lib/prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/var/lib/prometheus/data"]
