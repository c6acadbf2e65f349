# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: setup demo test test-fast bench bench-families clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check -e '.[prefect,test]'
	rm -f $(VENV)/.installed-* && touch $@

demo: setup
	$(PY) -m flows.demo

# Modules stay whole on one worker (--dist loadscope --no-loadscope-reorder): their servers and fixtures are set up once.
# One worker more than cores (up to 4): many tests wait on servers, deadlines and child processes, and a third
# worker on 2 cores keeps the CPU busy meanwhile (measured: 13.1 min against 14.1 with two).
WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0)) + 1))")
PYTEST := $(PY) -m pytest -q -n $(WORKERS) --dist loadscope --no-loadscope-reorder

test: setup
	$(PYTEST)

test-fast: setup
	$(PYTEST) -m "not slow"

bench: setup
	$(PY) bench/compare_maxtext.py

bench-families: setup
	$(PY) bench/compare_families.py

clean:
	rm -rf demo-out .pytest_cache .prefect
