# A new user's commands: `make test` and `make run` do all the set-up themselves.
VENV    := .venv
PY      := $(VENV)/bin/python
BASE    := $(VENV)/.base-stamp
STAMP   := $(VENV)/.installed-stamp

.PHONY: setup lint typecheck test run bench clean scaled-up scaled-down scaled-status

# The scaled layout's servers (scripts/scaled.py, docs/scaled.md) are Debian's too; its test
# skips, naming the package, where one cannot be installed.
SCALED_PACKAGES := postgresql postgresql-contrib redis-server haproxy
SYSTEM_PACKAGES := restic chromium chromium-driver $(SCALED_PACKAGES)

# What `make run` needs: the package and its dependencies (the demo's jobs are tar, gzip
# and cp, already on the machine). What the tests need comes on top: the test extras and
# the Debian packages above.
$(BASE): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e .
	touch $(BASE)

$(STAMP): $(BASE) scripts/system-packages.sh
	bash scripts/system-packages.sh $(SYSTEM_PACKAGES)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)
	@echo "sched is $(VENV)/bin/sched (or: source $(VENV)/bin/activate, then sched --help)"

lint: setup
	$(VENV)/bin/ruff check .

typecheck: setup
	$(VENV)/bin/mypy sched_core sched_node flows ops controller sched_ops sched_cli.py scripts

# Three test files at a time on two cores: the longest tests wait on real minutes (the suite
# keeps 2 cores 40 % busy on two workers), so a third worker fills the wait (8:00 -> 5:52 here;
# 7:01 with two busy loops beside it). The long files go first (tests/conftest.py).
test: lint typecheck
	$(VENV)/bin/pytest -n 3 --dist loadfile --no-loadscope-reorder

run: $(BASE)
	$(PY) -m ops.run_local

# BENCH_PREFECT=1 also runs the node's benchmarks (their own Prefect servers; ~75 min, then
# ~30 min for bench_limit: the node against APScheduler 4 and a warm loop).
bench: setup
	$(PY) bench/bench_core.py
ifneq ($(BENCH_PREFECT),)
	$(PY) bench/bench_node.py
	$(PY) bench/bench_limit.py --write
endif

# The scaled layout (docs/scaled.md): PostgreSQL, Redis, two Prefect API processes and one
# services process, two controller instances, HAProxy in front; state and logs in .scaled/.
scaled-up: setup
	@bash scripts/system-packages.sh $(SCALED_PACKAGES)
	$(PY) scripts/scaled.py up

scaled-down:
	@if [ -x $(PY) ]; then $(PY) scripts/scaled.py down; else echo "no $(VENV): nothing was started"; fi

scaled-status: setup
	$(PY) scripts/scaled.py status

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
