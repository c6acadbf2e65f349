# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv first, each with only what it
# runs: the demo needs the library and the "prefect" extra; the tests add the "test" extra (torch, transformers,
# pytest, the GCS emulator, ...), which the demo never imports and which is most of the venv's size and time.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
PINS := $(shell cksum < pyproject.toml | cut -d' ' -f1)
DEMO_EXTRAS := prefect
TEST_EXTRAS := prefect,test
# One stamp per extra set and version of pyproject.toml: `make demo` after `make test` installs nothing (the test
# set includes the demo's), `make test` after `make demo` adds only the test extra.
DEMO_STAMP := $(VENV)/.installed-demo-$(PINS)
TEST_STAMP := $(VENV)/.installed-test-$(PINS)
# JUnit XML of the last `make test`: the failing tests' names survive however long the output (.ci/run prints them).
RESULTS ?= test-results.xml

# $(call install,EXTRAS[,PIP_OPTIONS]): the venv (if missing), then the project with those extras; stale stamps are
# dropped.
define install
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check $(2) -e '.[$(1)]'
	find $(VENV) -maxdepth 1 -name '.installed-*' ! -name '.installed-*-$(PINS)' -delete
endef

.PHONY: setup setup-demo demo test test-fast bench bench-families clean

setup: $(TEST_STAMP)

setup-demo: $(DEMO_STAMP)

$(DEMO_STAMP): pyproject.toml
	$(call install,$(DEMO_EXTRAS))
	touch $@

# The test set is installed without compiling its 17 000 modules (pip compiles every one, one at a time: 83 s against
# 35 s without, on 2 cores): the suite compiles the few thousand it imports, once (tests/conftest.py writes bytecode
# even where PYTHONDONTWRITEBYTECODE=1), and `make demo` afterwards finds them compiled.
$(TEST_STAMP): pyproject.toml
	$(call install,$(TEST_EXTRAS),--no-compile)
	touch $@ $(DEMO_STAMP)

demo: setup-demo
	$(PY) -m flows.demo

# Modules stay whole on one worker (--dist loadscope --no-loadscope-reorder): their servers and fixtures are set up
# once (except the long independent cases tests/conftest.py spreads, SPREAD_MODULES).
# One worker more than cores (up to 4): many tests wait on servers, deadlines and child processes, and a third
# worker on 2 cores keeps the CPU busy meanwhile (measured: 13.1 min against 14.1 with two).
WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0)) + 1))")
PYTEST := $(PY) -m pytest -q -n $(WORKERS) --dist loadscope --no-loadscope-reorder --junitxml=$(RESULTS)
# The tests that hold a conversion's peak RSS to plan's prediction (marker `memory`) run last, after the parallel
# suite, a few conversions at a time: beside the parallel suite the same conversions peaked 20-70 MiB higher, a busy
# machine's figure, not the conversion's. Two at a time used to be no better (OLMo 3 32B's block, beside another
# case, 547 MiB against 546 predicted, 459 alone). The cause was glibc's: its arena cap was set after JAX had made
# 16 arenas, and a committed data file's chunks stayed resident (fixed in cli.run and monitor.trim). Since then, in
# a clean clone on a quiet 2-core machine, two at a time: all 46 peaks at 0.70-0.87 of their predictions, 9.2 min
# (one at a time: 14.2 min); in a later clean clone 0.82-0.96, 9.9 min (a fresh venv maps more of the shared
# libraries: ckptconv/plan/estimate.py's baseline). MEMORY_WORKERS=1 runs them one at a time.
# Three at a time since session 21: two kept 1.66 of the 2 cores busy (each test's wall above its CPU), and a third
# fills part of the rest. The same tree on this 2-core machine within the hour (late removal, tests/scratch.py): 433 s
# with three against 478 with two, every example at 0.67-0.86 of its prediction with three (0.69-0.91 with two); two
# clean clones with three: 404 and 451 s, examples at 0.69-0.91.
MEMORY_RESULTS := $(RESULTS:.xml=-memory.xml)
MEMORY_WORKERS ?= 3
# Only the modules that mark tests `memory` (pytest.mark.memory, as a decorator or pytestmark) are collected for it:
# each worker collecting all of tests/ for 31 tests took 15 s of a core (torch, transformers, Prefect, JAX imported
# by modules it then deselects), these three take 1 s.
MEMORY_MODULES := $(shell grep -l 'mark\.memory' tests/test_*.py)

# Each phase prints its wall time on its last line (`== ... phase: N s`), where CI's log shows where the minutes went,
# and the CPU time of its processes (the shell's `times`: user and system of the children it waited for, pytest's
# workers and the CLI processes they ran): on 2 cores a phase is CPU-bound when CPU is about twice its wall time,
# else waits (servers, deadlines, the disk) hold it up. Each test's own CPU seconds are in the JUnit files
# (tests/conftest.py, property cpu_seconds).
PHASE_START := start=$$(date +%s)
phase_end = status=$$?; t=$${TMPDIR:-/tmp}/ckptconv-times.$$$$; times > $$t; \
	echo "== $(1) phase: $$(( $$(date +%s) - start )) s, CPU (user system) $$(tail -n 1 $$t)"; rm -f $$t; exit $$status
MEMORY_PYTEST := $(PY) -m pytest -q $(if $(filter-out 1,$(MEMORY_WORKERS)),-n $(MEMORY_WORKERS)) -m memory \
	--junitxml=$(MEMORY_RESULTS) $(MEMORY_MODULES)

test: setup
	@$(PHASE_START); $(PYTEST) -m "not memory"; $(call phase_end,parallel)
	@$(PHASE_START); $(MEMORY_PYTEST); $(call phase_end,memory)

test-fast: setup
	$(PYTEST) -m "not slow"

bench: setup
	$(PY) -m bench speed

bench-families: setup
	$(PY) -m bench families

clean:
	rm -rf demo-out .pytest_cache .prefect $(RESULTS)
