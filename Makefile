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

# Two pytest workers (pytest-xdist; the next test goes to whichever is free): one process
# leaves a core idle while a test waits on the processes it started. Measured on one
# (slow) day: the whole suite 1,087 s in one process, 800 s on two; the quick tier 152 s
# and 84 s. Three workers do not help: on 2026-12-04 the suite took 779 s on three against 726 s
# on two, the cores busy throughout (each test's processes compute too). PYTEST_WORKERS=0 runs it
# in one process.
PYTEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -p no:cacheprovider $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist worksteal)

# The whole suite, as CI runs it (.ci/run): type check, then every test.
test: $(STAMP)
	$(PY) -m mypy
	$(PYTEST)

# The quick tier, for every edit: the tests that start no process (no node, cluster or
# subprocess; tests/helpers/process_guard.py fails one that does without the mark).
test-fast: $(STAMP)
	$(PYTEST) -m "not multiprocess"

typecheck: $(STAMP)
	$(PY) -m mypy

demo: $(STAMP)
	$(PY) -m examples.train_gpt

bench: $(STAMP)
	$(PY) -m benchmarks.transport
	$(PY) -m benchmarks.actors
	$(PY) -m benchmarks.hop
	$(PY) -m benchmarks.pipeline
	$(PY) -m benchmarks.overhead

# On a GPU machine, in a venv whose torch is a CUDA build (setup installs the CPU wheel: replace it with
# `$(PY) -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128` or the like).
# Not tied to setup, which would put the CPU wheel back. Without CUDA it says so and exits 0.
gpu-check:
	$(PY) -m benchmarks.gpu

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .hypothesis
