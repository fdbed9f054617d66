# A new user's commands: `make test` and `make run` do all the set-up themselves.
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-stamp

.PHONY: setup lint typecheck test run bench clean

SYSTEM_PACKAGES := restic chromium chromium-driver

$(STAMP): pyproject.toml constraints.txt scripts/system-packages.sh
	bash scripts/system-packages.sh $(SYSTEM_PACKAGES)
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)
	@echo "sched is $(VENV)/bin/sched (or: source $(VENV)/bin/activate, then sched --help)"

lint: setup
	$(VENV)/bin/ruff check .

typecheck: setup
	$(VENV)/bin/mypy sched_core flows deployments controller sched_ops sched_cli.py

test: lint typecheck
	$(VENV)/bin/pytest

run: setup
	$(PY) -m deployments.run_local

# BENCH_PREFECT=1 also runs the Prefect benchmarks (each starts its own server; ~40 min, plus
# ~20 min for bench_propagation).
bench: setup
	$(PY) bench/bench_core.py
ifneq ($(BENCH_PREFECT),)
	$(PY) bench/bench_idle.py
	$(PY) bench/bench_plan.py
	$(PY) bench/bench_propagation.py
endif

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
