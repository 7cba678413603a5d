# rlfleet service images: one multi-stage file, one target per service.
#
#   target       entry point                         built by docker-compose.yml from
#   controller   python -m services.controller       the slim base + CPU torch: the controller needs no GPU
#   actor        python -m services.actor            the GPU base (a CUDA image on GPU hosts)
#   critic       python -m services.critic           the GPU base
#   reward       python -m services.reward           the GPU base
#   reference    python -m services.reference        the GPU base
#   prepare      python -m services.prepare          the slim base (one-shot: write fleet.yaml, build the tiny model)
#
# "Slim" and "GPU" are the same file with different build arguments: docker-compose.yml passes
# RLFLEET_SLIM_BASE_IMAGE / RLFLEET_CPU_TORCH_SPEC to the controller and prepare, and
# RLFLEET_GPU_BASE_IMAGE / RLFLEET_TORCH_SPEC to the others. On a CPU host all four default to the
# local Debian base and the CPU wheel, so every target shares every layer but the last.
#
# Build arguments:
#   BASE_IMAGE       base of the builder and of every service image. Default: rlfleet/base:bookworm, built
#                    locally by scripts/docker_base.sh (no image registry needed). On a GPU host use a CUDA
#                    image with Python >= 3.11, e.g. nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 (python3
#                    is installed from apt when missing) or pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
#                    (its torch is reused: set TORCH_SPEC="").
#   TORCH_SPEC       how pip installs torch. "torch==2.13.0" (default) takes the CPU wheel that
#                    scripts/docker_build.sh stages in docker/wheels/; "torch" on GPU hosts takes PyPI's CUDA
#                    build; "" keeps the base image's torch.
#   TORCH_INDEX_URL  index for the torch step only, e.g. https://download.pytorch.org/whl/cpu for a CPU
#                    torch from PyPI-less indexes (the slim controller image on a GPU host).
#   PIP_INDEX_URL    a PyPI mirror, if any.
#   PINNED           1 (default): the dependencies at the exact versions of constraints.txt (what `make
#                    setup` installs; resolved on Python 3.11); 0: the newest pyproject.toml allows, e.g.
#                    on a base image whose Python has no wheel for a pinned version.
#   EXTRAS           pyproject.toml extras to add, comma-separated: "" (default, the base images) or
#                    "tasks,track,lora" (the extras images: reasoning-gym and math-verify tasks, the
#                    TensorBoard / W&B / MLflow trackers, LoRA through peft; `scripts/docker_build.sh
#                    --extras` builds them as rlfleet/<service>:extras). The image's label
#                    rlfleet.extras says which it has.
#   RLFLEET_UID      uid of the non-root user the services run as (default 10001); bind-mounted data
#                    folders must be writable by it.
#
# The builder stage installs into /opt/rlfleet (a venv); service images copy only that venv and the
# source, so wheels and caches never reach them. Layers: the OS (rarely changes), torch, the
# dependencies from pyproject.toml, the extras (EXTRAS; empty in the base images), then the source
# (changes every commit) last.
#
# Builds need PyPI; on hosts whose network reaches it only from the host namespace, build with
# `--network host` (docker-compose.yml does).

ARG BASE_IMAGE=rlfleet/base:bookworm

# ---------------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS builder
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=
ARG PIP_INDEX_URL=
ARG PINNED=1
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_DEFAULT_TIMEOUT=120 DEBIAN_FRONTEND=noninteractive
COPY docker/ensure_python.sh /usr/local/bin/rlfleet-ensure-python
RUN sh /usr/local/bin/rlfleet-ensure-python
# --system-site-packages: a base image that ships torch (pytorch/pytorch) lends it to the venv.
RUN python3 -m venv --system-site-packages /opt/rlfleet
ENV PATH=/opt/rlfleet/bin:$PATH
COPY docker/wheels/ /tmp/wheels/
RUN set -eu; \
    if [ -n "$TORCH_SPEC" ]; then \
      pip install --find-links /tmp/wheels ${PIP_INDEX_URL:+--index-url "$PIP_INDEX_URL"} \
        ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"; \
    fi; \
    python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
COPY pyproject.toml constraints.txt /tmp/src/
# Dependencies only (the source is not copied yet, so editing it reuses this layer); nvidia-ml-py for
# GPU metrics and `rlfleet plan` (a no-op without a driver). The constraints leave torch out: the
# step above (TORCH_SPEC) decides it, and a pin here would replace a base image's own torch.
RUN set -eu; \
    python -c "import tomllib; d = tomllib.load(open('/tmp/src/pyproject.toml', 'rb')); print('\n'.join(d['project']['dependencies'] + d['project']['optional-dependencies']['gpu']))" > /tmp/requirements.txt; \
    if [ "$PINNED" = 1 ]; then grep -v '^torch==' /tmp/src/constraints.txt > /tmp/constraints.txt; else : > /tmp/constraints.txt; fi; \
    pip install --find-links /tmp/wheels ${PIP_INDEX_URL:+--index-url "$PIP_INDEX_URL"} -c /tmp/constraints.txt -r /tmp/requirements.txt; \
    pip check

# ---------------------------------------------------------------------------------------------------
# Wheels for the extras (EXTRAS) that the index has only as source, such as pycosat (C; reasoning-gym
# needs it): built here, with a compiler from apt that never reaches the service images, which copy
# only these wheels. Nothing happens when EXTRAS is "" (the base images).
FROM builder AS extras-wheels
ARG EXTRAS=
ARG PIP_INDEX_URL=
COPY docker/extras_requirements.py /tmp/src/
RUN set -eu; \
    mkdir -p /opt/extras-wheels; \
    if [ -n "$EXTRAS" ]; then \
      python /tmp/src/extras_requirements.py "$EXTRAS" /tmp/src/pyproject.toml > /tmp/extras.txt; \
      pip install --quiet --dry-run --report /tmp/report.json ${PIP_INDEX_URL:+--index-url "$PIP_INDEX_URL"} \
        -c /tmp/constraints.txt -r /tmp/extras.txt; \
      python /tmp/src/extras_requirements.py --sdists /tmp/report.json > /tmp/sdists.txt; \
      if [ -s /tmp/sdists.txt ]; then \
        echo "extras built from source: $(tr '\n' ' ' < /tmp/sdists.txt)"; \
        tools=""; \
        command -v cc >/dev/null 2>&1 || tools="gcc libc6-dev"; \
        python -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
          || tools="$tools python3-dev"; \
        if [ -n "$tools" ]; then apt-get update -q && apt-get install -y -q --no-install-recommends $tools; fi; \
        pip wheel --no-deps -w /opt/extras-wheels ${PIP_INDEX_URL:+--index-url "$PIP_INDEX_URL"} \
          -c /tmp/constraints.txt -r /tmp/sdists.txt; \
        if [ -n "$tools" ]; then apt-get purge -y -q --auto-remove $tools; apt-get clean; rm -rf /var/lib/apt/lists/*; fi; \
      fi; \
    fi

# ---------------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS app
ARG RLFLEET_UID=10001
ENV DEBIAN_FRONTEND=noninteractive
COPY docker/ensure_python.sh /usr/local/bin/rlfleet-ensure-python
RUN sh /usr/local/bin/rlfleet-ensure-python \
 && (getent passwd "$RLFLEET_UID" >/dev/null || useradd --uid "$RLFLEET_UID" --create-home --shell /usr/sbin/nologin rlfleet) \
 && mkdir -p /var/lib/rlfleet/run /etc/rlfleet \
 && chown -R "$RLFLEET_UID" /var/lib/rlfleet
COPY --from=builder /opt/rlfleet /opt/rlfleet
COPY docker/healthcheck.py /usr/local/lib/rlfleet/healthcheck.py
# The extras image (EXTRAS=tasks,track,lora): the extras' dependencies installed into the venv as one
# more layer, at the versions of constraints.txt (PINNED=1), wheels only (those built from source come
# from the extras-wheels stage). Every layer above is the base image's (the ARG comes only now; the
# wheel folder is empty there), the source below comes after, and all service targets share this
# layer, so the extras set costs one layer over the base set. EXTRAS="" installs nothing.
COPY --from=extras-wheels /opt/extras-wheels/ /tmp/extras-wheels/
COPY pyproject.toml constraints.txt docker/extras_requirements.py /tmp/src/
ARG EXTRAS=
ARG PINNED=1
ARG PIP_INDEX_URL=
RUN set -eu; \
    if [ -n "$EXTRAS" ]; then \
      export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_DEFAULT_TIMEOUT=120; \
      /opt/rlfleet/bin/python /tmp/src/extras_requirements.py "$EXTRAS" /tmp/src/pyproject.toml > /tmp/extras.txt; \
      if [ "$PINNED" = 1 ]; then grep -v '^torch==' /tmp/src/constraints.txt > /tmp/constraints.txt; else : > /tmp/constraints.txt; fi; \
      /opt/rlfleet/bin/pip install --only-binary :all: --find-links /tmp/extras-wheels \
        ${PIP_INDEX_URL:+--index-url "$PIP_INDEX_URL"} -c /tmp/constraints.txt -r /tmp/extras.txt; \
      /opt/rlfleet/bin/pip check; \
      rm -f /tmp/extras.txt /tmp/constraints.txt; \
    fi; \
    rm -rf /tmp/extras-wheels
LABEL rlfleet.extras="${EXTRAS}"
# Read by `python -m services.prepare`: in a base image a config that needs an extra is told which
# image to use.
ENV RLFLEET_IMAGE_EXTRAS="${EXTRAS}"
COPY examples/ /app/examples/
COPY services/ /app/services/
ENV PATH=/opt/rlfleet/bin:$PATH \
    PYTHONPATH=/app \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    MPLCONFIGDIR=/tmp/matplotlib \
    HOME=/tmp \
    RLFLEET_CONFIG=/var/lib/rlfleet/run/fleet.yaml
WORKDIR /app
USER ${RLFLEET_UID}
# Ready means /readyz answers 200 on the service's HTTP port (read from RLFLEET_CONFIG).
HEALTHCHECK --interval=5s --timeout=4s --start-period=300s --retries=3 \
  CMD ["python", "/usr/local/lib/rlfleet/healthcheck.py"]

# ---------------------------------------------------------------------------------------------------
# One target per service. `CMD` is the config: override it with `--config OTHER` when needed.
FROM app AS controller
ENV RLFLEET_SERVICE=controller
ENTRYPOINT ["python", "-m", "services.controller"]
CMD ["--config", "/var/lib/rlfleet/run/fleet.yaml"]

FROM app AS actor
ENV RLFLEET_SERVICE=actor
ENTRYPOINT ["python", "-m", "services.actor"]
CMD ["--config", "/var/lib/rlfleet/run/fleet.yaml"]

FROM app AS critic
ENV RLFLEET_SERVICE=critic
ENTRYPOINT ["python", "-m", "services.critic"]
CMD ["--config", "/var/lib/rlfleet/run/fleet.yaml"]

FROM app AS reward
ENV RLFLEET_SERVICE=reward
ENTRYPOINT ["python", "-m", "services.reward"]
CMD ["--config", "/var/lib/rlfleet/run/fleet.yaml"]

FROM app AS reference
ENV RLFLEET_SERVICE=reference
ENTRYPOINT ["python", "-m", "services.reference"]
CMD ["--config", "/var/lib/rlfleet/run/fleet.yaml"]

FROM app AS prepare
ENV RLFLEET_SERVICE=prepare
HEALTHCHECK NONE
ENTRYPOINT ["python", "-m", "services.prepare"]
CMD ["--help"]
