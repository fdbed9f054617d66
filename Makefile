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

bench: setup
	$(PY) bench/bench_core.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
