# The two commands of the README's quick start. Each creates .venv on first use.
PY := .venv/bin/python

.PHONY: demo test test-all lint venv

venv:
	@bash scripts/bootstrap.sh

# The main job on a bundled example: tune examples/mlp.py for this machine.
demo: venv
	$(PY) -m advisor.cli tune examples/mlp.py --trials 12

# The whole test suite, as CI runs it; the 25 slowest tests are listed at the end, so that a run
# that grows shows where. TEST_JOBS test processes (pytest-xdist); one that runs out of tests takes
# some from the other's queue (worksteal), so neither waits on the other's last long file, and a
# file's module fixtures (a daemon, a PostgreSQL server) start once in each process that runs it.
# The suite is sized for, and checked on, a 2-core machine with two CPU-bound processes beside it.
TEST_JOBS ?= 2
test: venv
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist worksteal --durations=25 -m "not slow" tests
	.venv/bin/ruff check advisor probes policies tests examples scripts

lint: venv
	.venv/bin/ruff check advisor probes policies tests examples scripts

# Everything, the slow set too (tests/slow.txt: whole tunes through the framework suites, two-rank
# faults, storage outages), for a change to trials, the search or the frameworks.
test-all: venv
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist worksteal --durations=25 tests
	.venv/bin/ruff check advisor probes policies tests examples scripts
