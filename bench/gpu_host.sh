#!/usr/bin/env bash
# Set up an offline GPU host (Python 3.12, torch preinstalled) for the benchmarks, from what was built here:
#   WITH_LEARN=1 ../shared/gpu-host/wheelhouse.sh .whl   -> .whl/parts/whl.tar.NN, .whl/redis
#   (reasoning-gym and its wheel-less dependencies, built for cp312: see bench/README or the note)  -> .whl/rg
# The parts travel one per call (each call copies its part to /tmp/parts); the last call sources this file:
#   . bench/gpu_host.sh        # unpacks and installs once into /tmp/site, then exports the environment
set -euo pipefail
if [ ! -f /tmp/site/.rlfleet-installed ]; then
  mkdir -p /tmp/parts /tmp/unpack
  cp -n .whl/parts/whl.tar.* /tmp/parts/ 2>/dev/null || true
  (cd /tmp/unpack && cat /tmp/parts/whl.tar.* | tar x)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    /tmp/unpack/whl/*.whl .whl/rg/*.whl
  mkdir -p /tmp/redis && cp -r .whl/redis/. /tmp/redis/
  touch /tmp/site/.rlfleet-installed
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/redis/bin:$PATH LD_LIBRARY_PATH=/tmp/redis/lib:${LD_LIBRARY_PATH:-}
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
set +eu
