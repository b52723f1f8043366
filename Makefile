# Every target sets itself up: `make test` and `make demo` work on a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test test-fast demo typecheck bench gpu-check clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,examples,hf]'
	touch $(STAMP)

setup: $(STAMP)

# The whole suite, as CI runs it (.ci/run): type check, then every test.
test: $(STAMP)
	$(PY) -m mypy
	$(PY) -m pytest -q -p no:cacheprovider

# The quick tier, for every edit: the tests that start no process (no node, cluster or
# subprocess; tests/helpers/process_guard.py fails one that does without the mark).
test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not multiprocess"

typecheck: $(STAMP)
	$(PY) -m mypy

demo: $(STAMP)
	$(PY) -m examples.train_gpt

bench: $(STAMP)
	$(PY) -m benchmarks.transport
	$(PY) -m benchmarks.actors
	$(PY) -m benchmarks.pipeline
	$(PY) -m benchmarks.overhead

# On a GPU machine, in a venv whose torch is a CUDA build (setup installs the CPU wheel: replace it with
# `$(PY) -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128` or the like).
# Not tied to setup, which would put the CPU wheel back. Without CUDA it says so and exits 0.
gpu-check:
	$(PY) -m benchmarks.gpu

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .hypothesis
