# One entry point. `make test` builds the environment from scratch (idempotent), lints, and runs pytest.
# `make demo` runs the main job. Every target reuses .venv/ and rebuilds nothing already there.
PY_BOOT ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
MMCV_VERSION := 2.1.0

.PHONY: env test test-quick lint demo benchmark benchmark-kernels benchmark-training info clean-ext

$(PY):
	$(PY_BOOT) -m venv $(VENV)
	$(PIP) install --upgrade pip

# Stamps make a second run a no-op; each stamp depends on what it installs.
$(VENV)/.stamp-build: requirements/build.txt | $(PY)
	$(PIP) install -r requirements/build.txt
	touch $@

$(VENV)/.stamp-torch: requirements/core.txt $(VENV)/.stamp-build
	$(PIP) install -r requirements/core.txt
	touch $@

$(VENV)/.stamp-mmcv: $(VENV)/.stamp-torch
	$(PY) -c "import mmcv, sys; sys.exit(mmcv.__version__ != '$(MMCV_VERSION)')" 2>/dev/null || \
	  bash tools/setup/build_mmcv.sh $(PY)
	touch $@

$(VENV)/.stamp-stack: requirements/stack.txt requirements/dev.txt $(VENV)/.stamp-mmcv
	$(PIP) install -r requirements/stack.txt -r requirements/dev.txt
	touch $@

# Builds mmseg_mesa._C when a CUDA toolkit is found (see setup.py); pure Python otherwise.
$(VENV)/.stamp-pkg: setup.py $(VENV)/.stamp-stack $(wildcard csrc/*)
	$(PIP) install --no-build-isolation --no-deps -e .
	$(PY) -m mmseg_mesa.info
	touch $@

env: $(VENV)/.stamp-pkg

lint: env
	$(VENV)/bin/ruff check mmseg_mesa tools tests configs setup.py

# pytest-xdist runs the tests on every core (PYTEST_WORKERS=0: in this process); each file's tests
# stay on one worker, so its module fixtures (the GPU check's dry run, the wheel build) run once.
PYTEST_WORKERS ?= auto
PYTEST := $(VENV)/bin/pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadfile

test: env lint
	$(PYTEST) tests

# The quick tier: every test but those marked slow (subprocesses, end-to-end runs, whole models).
test-quick: env lint
	$(PYTEST) -m "not slow" tests

# The main job: train the demo model with and without Mesa and compare memory and accuracy.
demo: env
	$(PY) tools/demo.py

benchmark: env
	$(PY) tools/benchmark_memory.py --json work_dirs/benchmarks/memory.json \
	  --plot work_dirs/benchmarks/memory.png

benchmark-kernels: env
	$(PY) tools/benchmark_kernels.py --json work_dirs/benchmarks/kernels.json

# Same accuracy? The demo model for 3 seeds, baseline and default (about 6.5 min on 2 cores);
# e.g. TRAINING_ARGS="--modes baseline default paper stored-maps" for more presets.
TRAINING_ARGS ?=
benchmark-training: env
	$(PY) tools/benchmark_training.py $(TRAINING_ARGS)

info: env
	$(PY) -m mmseg_mesa.info

# The GPU run (tools/gpu_check.sh; CONTRIBUTING.md, "Checking on a GPU"). `make gpu-wheels` here fills
# .gpu-wheels/ for the GPU machine, where `make gpu-check` runs it (no .venv there: python3);
# `make gpu-check DRY_RUN=1` is its CPU dry run here, into work_dirs/gpu_check/.
.PHONY: gpu-wheels gpu-check
gpu-wheels:
	bash tools/setup/prepare_gpu_wheels.sh

gpu-check:
	bash tools/gpu_check.sh $(if $(DRY_RUN),--dry-run --out work_dirs/gpu_check/out \
	  --work work_dirs/gpu_check/work)

clean-ext:
	rm -f mmseg_mesa/_C*.so mmseg_mesa/_build_info.py $(VENV)/.stamp-pkg
