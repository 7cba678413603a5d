#!/usr/bin/env bash
# Build the local base image (Debian bookworm, minbase, Python 3.11 from Debian packages) without any
# image registry: debootstrap a root filesystem from the Debian mirror and `docker import` it.
#
#   scripts/docker_base.sh            build rlfleet/base:bookworm unless it is already there and current
#   scripts/docker_base.sh --force    rebuild it
#
# Environment:
#   RLFLEET_BASE_TAG   image tag to produce             (default rlfleet/base:bookworm)
#   DEBIAN_SUITE       Debian release                   (default bookworm: Python 3.11)
#   DEBIAN_MIRROR      mirror for debootstrap and apt   (default http://deb.debian.org/debian)
#   DEBOOTSTRAP_CACHE  folder keeping downloaded .debs between builds (default ~/.cache/rlfleet/debootstrap)
#
# Hosts that reach TLS sites through an intercepting proxy trust its CA in
# /usr/local/share/ca-certificates; those certificates are copied into the image so that pip and apt
# inside `docker build` work the same way as on the host. Elsewhere nothing is copied.
#
# On a host that can pull images none of this is needed: build the service images with
# `--build-arg BASE_IMAGE=python:3.11-slim-bookworm` (or a CUDA image for GPU services; see Dockerfile).
set -euo pipefail
cd "$(dirname "$0")/.."

TAG="${RLFLEET_BASE_TAG:-rlfleet/base:bookworm}"
SUITE="${DEBIAN_SUITE:-bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
CACHE="${DEBOOTSTRAP_CACHE:-${HOME:-/root}/.cache/rlfleet/debootstrap}"
PACKAGES="python3,python3-venv,python3-pip,ca-certificates"
FORCE=0
[ "${1:-}" = "--force" ] && FORCE=1

# The image is current when it was made by this very script with these settings.
RECIPE="$( (cat "$0"; echo "$SUITE $MIRROR $PACKAGES"; cat /usr/local/share/ca-certificates/*.crt 2>/dev/null || true) \
  | sha256sum | cut -c1-16)"

if ! docker info >/dev/null 2>&1; then
  echo "docker_base: no Docker engine answers (start one: scripts/docker_engine.sh)" >&2
  exit 1
fi
if [ "$FORCE" = 0 ] && [ "$(docker image inspect -f '{{ index .Config.Labels "rlfleet.recipe" }}' "$TAG" 2>/dev/null)" = "$RECIPE" ]; then
  echo "docker_base: $TAG is current (recipe $RECIPE)"
  exit 0
fi

if ! command -v debootstrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -q debootstrap >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q debootstrap >/dev/null; }
  else
    echo "docker_base: debootstrap is missing (sudo apt-get install debootstrap)" >&2
    exit 1
  fi
fi
if [ "$(id -u)" != 0 ]; then
  echo "docker_base: debootstrap needs root" >&2
  exit 1
fi

t0=$(date +%s)
WORK="$(mktemp -d "${TMPDIR:-/tmp}/rlfleet-rootfs.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
ROOT="$WORK/rootfs"
mkdir -p "$CACHE"
echo "docker_base: debootstrap $SUITE ($PACKAGES) from $MIRROR"
if ! debootstrap --variant=minbase --include="$PACKAGES" --cache-dir="$CACHE" "$SUITE" "$ROOT" "$MIRROR" \
     >"$WORK/debootstrap.log" 2>&1; then
  tail -30 "$WORK/debootstrap.log" >&2
  [ -f "$ROOT/debootstrap/debootstrap.log" ] && tail -30 "$ROOT/debootstrap/debootstrap.log" >&2
  echo "docker_base: debootstrap failed" >&2
  exit 1
fi

# apt sources with updates and security, like the host's.
cat >"$ROOT/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb ${MIRROR%/debian}/debian-security $SUITE-security main
EOF
# Keep images small: no recommends, no docs, no apt caches.
cat >"$ROOT/etc/apt/apt.conf.d/90rlfleet" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
EOF
cat >"$ROOT/etc/dpkg/dpkg.cfg.d/90rlfleet-nodoc" <<'EOF'
path-exclude /usr/share/doc/*
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF

# The host's extra CAs (a TLS-intercepting proxy), so pip and apt work inside builds.
if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
  cp /usr/local/share/ca-certificates/*.crt "$ROOT/usr/local/share/ca-certificates/"
  chroot "$ROOT" update-ca-certificates >/dev/null 2>&1
fi

rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/* "$ROOT"/usr/share/doc/* \
       "$ROOT"/usr/share/man/* "$ROOT"/usr/share/info/* "$ROOT"/var/log/*.log "$ROOT"/debootstrap
find "$ROOT/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
: >"$ROOT/etc/hostname"

tar --numeric-owner -C "$ROOT" -c . | docker import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENV REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt' \
  --change "LABEL rlfleet.recipe=$RECIPE" \
  --change 'CMD ["/bin/bash"]' \
  - "$TAG" >/dev/null
echo "docker_base: built $TAG in $(( $(date +%s) - t0 ))s ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"
