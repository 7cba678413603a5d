#!/usr/bin/env bash
# Build every image the compose stack needs, without an image registry:
#   1. rlfleet/base:bookworm            scripts/docker_base.sh (debootstrap + docker import; cached)
#   2. docker/wheels/                   a local torch wheel, if pip has one in its find-links folders
#   3. rlfleet/<service>:local, rlfleet/redis:local, rlfleet/prometheus:local
#                                       `compose build` (layers cached between runs)
#
#   scripts/docker_build.sh [-f docker-compose.cpu.yml] [--extras] [SERVICE...]
#
# --extras builds the extras images instead: the same images plus one layer with the `tasks`, `track`
# and `lora` extras of pyproject.toml (reasoning-gym and math-verify, TensorBoard / W&B / MLflow, peft),
# pinned by constraints.txt, tagged rlfleet/<service>:extras (run them with RLFLEET_TAG=extras).
# RLFLEET_EXTRAS picks other extras (e.g. tasks,track,lora,gguf), RLFLEET_TAG another tag. Build the
# base images first (or in the same cache): the extras images reuse every one of their layers.
#
# Uses `docker compose` when the plugin is there, else `docker-compose` (Debian's v1). Extra
# environment is passed through to compose (RLFLEET_TORCH_SPEC, RLFLEET_GPU_BASE_IMAGE, ...).
set -euo pipefail
cd "$(dirname "$0")/.."

FILE=docker-compose.cpu.yml
while [ $# -gt 0 ]; do
  case "$1" in
    -f) FILE="$2"; shift 2 ;;
    --extras)
      export RLFLEET_EXTRAS="${RLFLEET_EXTRAS:-tasks,track,lora}" RLFLEET_TAG="${RLFLEET_TAG:-extras}"
      shift ;;
    *) break ;;
  esac
done
if [ -n "${RLFLEET_EXTRAS:-}" ]; then
  echo "docker_build: extras ${RLFLEET_EXTRAS} as rlfleet/<service>:${RLFLEET_TAG:-local}"
fi

scripts/docker_engine.sh
t0=$(date +%s)
scripts/docker_base.sh
t1=$(date +%s)

# Stage a local torch wheel for the build: pip's own find-links folders ($PIP_FIND_LINKS, pip config)
# are searched for the version RLFLEET_TORCH_SPEC pins (torch==2.13.0 by default).
mkdir -p docker/wheels
spec="${RLFLEET_TORCH_SPEC-torch==2.13.0}"
if [ -n "$spec" ] && [ "${spec#torch==}" != "$spec" ]; then
  version="${spec#torch==}"
  dirs="${PIP_FIND_LINKS:-} $(python3 -m pip config list 2>/dev/null | sed -n "s/^[a-z]*\.find-links='\(.*\)'$/\1/p")"
  staged=""
  for dir in $dirs; do
    dir="${dir#file://}"
    for whl in "$dir"/torch-"$version"[+-]*.whl; do
      [ -f "$whl" ] || continue
      [ -f "docker/wheels/$(basename "$whl")" ] || ln "$whl" docker/wheels/ 2>/dev/null || cp "$whl" docker/wheels/
      staged="$(basename "$whl")"
      break 2
    done
  done
  if [ -n "$staged" ]; then
    echo "docker_build: torch from $staged"
  elif ! ls docker/wheels/torch-"$version"[+-]*.whl >/dev/null 2>&1 && [ -z "${RLFLEET_TORCH_INDEX_URL:-}" ]; then
    echo "docker_build: no local torch $version wheel; PyPI's Linux torch is the CUDA build (several GB)." \
         "For CPU images set RLFLEET_TORCH_INDEX_URL and RLFLEET_CPU_TORCH_INDEX_URL to https://download.pytorch.org/whl/cpu" >&2
  fi
fi

if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose); else COMPOSE=(docker-compose); fi
# Building reads no secret and no placement, but compose interpolates the whole file first.
export REDIS_PASSWORD="${REDIS_PASSWORD:-unused-at-build-time}"
for s in CONTROLLER ACTOR CRITIC REWARD REFERENCE; do
  v="RLFLEET_${s}_GPUS"
  export "$v=${!v:-none}"
done
"${COMPOSE[@]}" -f "$FILE" --profile critic --profile reference build "$@"
t2=$(date +%s)
echo "docker_build: base $((t1 - t0))s, service images $((t2 - t1))s (tag ${RLFLEET_TAG:-local})"
