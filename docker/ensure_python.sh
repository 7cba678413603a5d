#!/bin/sh
# Make sure the image has python3 (>= 3.11) with venv: the local Debian base has it; a plain CUDA
# image (nvidia/cuda:*-ubuntu24.04) gets it from apt. Runs at build time only.
set -eu
if command -v python3 >/dev/null 2>&1 && python3 -c 'import sys, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  exit 0
fi
if command -v apt-get >/dev/null 2>&1; then
  apt-get update -q
  apt-get install -y -q --no-install-recommends python3 python3-venv python3-pip ca-certificates
  rm -rf /var/lib/apt/lists/*
fi
python3 -c 'import sys, venv; sys.exit(sys.version_info < (3, 11))' || {
  echo "rlfleet needs Python >= 3.11 with venv in BASE_IMAGE (found: $(python3 --version 2>&1 || echo none))" >&2
  exit 1
}
