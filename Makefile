# Quick start targets. Each one sets up what it needs (a local .venv) and is safe to re-run.
#   make demo   — coordinator + 2 volunteer clients + learner on the built-in tiny model (a few minutes)
#   make test   — lint, type check, the import contracts (docs/architecture.md) and the whole test suite
#   make test-twice — the same suite twice at once (CI's timing, doubled), for a change that touches tests/
PYTHON ?= python3
VENV   ?= .venv
# The CPU build of torch for the quick start; GPU users can pass e.g. TORCH_SPEC="torch" for their own build.
TORCH_SPEC ?= torch==2.13.0
OUT    ?= demo-out

BIN := $(VENV)/bin

.PHONY: setup demo test test-twice lint clean browser postgres

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# llama-cpp-python compiles llama.cpp (~4 min on 2 cores; pip caches the wheel). CPU build here, portable
# (no -march=native); for a GPU pass e.g. LLAMA_CMAKE_ARGS="-DGGML_CUDA=on" or "-DGGML_METAL=on".
LLAMA_CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@command -v cc >/dev/null 2>&1 && command -v c++ >/dev/null 2>&1 || { \
	  echo "installing a C/C++ compiler for llama-cpp-python (apt-get install build-essential)"; \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq build-essential; \
	  else echo "error: no C/C++ compiler; install build-essential (Debian/Ubuntu) or Xcode tools" >&2; exit 1; fi; }
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	@# the same wheel kept for tests/integration/test_installer.py's real install (from pip's cache or find-links)
	$(BIN)/pip download --quiet --no-deps --dest $(VENV)/wheels "$(TORCH_SPEC)"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install --quiet -e ".[dev,coordinator,torch,llama,math,data,postgres,reasoning-gym,p2p]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/echo-swarm demo --clients 2 --out $(OUT)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# Headless Chromium for the status-page browser test: Debian's package, installed once (needs root and apt;
# skipped when a chromium is already on PATH or $$ECHO_SWARM_CHROMIUM names one).
browser:
	@if [ -n "$$ECHO_SWARM_CHROMIUM" ] || command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then \
	  echo "chromium: present"; \
	else \
	  echo "installing Debian's chromium for the status-page browser test"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	fi

# PostgreSQL server binaries for the store tests (each test session starts its own throwaway server): Debian's
# package, installed once (needs root and apt; skipped when initdb is found, see echo_swarm/pgserver.py).
postgres:
	@if [ -n "$$ECHO_SWARM_PG_BINDIR" ] || command -v pg_ctl >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
	  echo "postgresql: present"; \
	elif [ "$$(id -u)" = 0 ]; then \
	  echo "installing Debian's postgresql for the store tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; \
	else \
	  echo "error: the store tests need PostgreSQL's server binaries; install postgresql (Debian/Ubuntu) or set ECHO_SWARM_PG_BINDIR" >&2; exit 1; \
	fi

# The suite on TEST_WORKERS pytest-xdist workers (much of its time is real processes waiting on each other, which
# two workers overlap), then the tests marked `serial` alone (they compare rates, which a neighbour's load would
# skew). --durations and the JUnit reports: the suite watches its own time (bench/suite_time.py writes the table
# in docs/operations.md §6). A test that skips fails here (tests/conftest.py): what CI cannot run is a failure to
# fix, not a pass. Both phases run; the target fails if either did (a selection with no serial test is fine).
# Each phase is a command writing its JUnit report into the folder given ($(call PARALLEL_PHASE,folder[,options])).
TEST_WORKERS ?= 2
PYTEST_ARGS ?=
PARALLEL_PHASE = ECHO_SWARM_NO_SKIPS=1 $(BIN)/python -m pytest -ra --durations=25 -n $(TEST_WORKERS) --dist loadgroup \
	-m "not serial" --junitxml=$(1)/junit-parallel.xml $(2) $(PYTEST_ARGS)
SERIAL_PHASE = ECHO_SWARM_NO_SKIPS=1 $(BIN)/python -m pytest -ra --durations=10 -m serial \
	--junitxml=$(1)/junit-serial.xml $(2) $(PYTEST_ARGS)
test: lint browser postgres
	@mkdir -p test-artifacts
	@status=0; \
	$(call PARALLEL_PHASE,test-artifacts) || status=$$?; \
	$(call SERIAL_PHASE,test-artifacts) || { rc=$$?; [ $$rc = 5 ] || status=$$rc; }; \
	$(BIN)/python bench/suite_time.py --junit test-artifacts/junit-parallel.xml test-artifacts/junit-serial.xml || true; \
	exit $$status

# The suite twice at once, as a change touching tests/ runs it before it stops: a test that passes alone but not
# beside a copy of itself depends on the machine's timing, and CI's loaded 2-core machine would find it one day.
# The two parallel phases run together (each on TEST_WORKERS workers, its own TMPDIR so that pytest's temporary
# folders, run directories and PostgreSQL servers cannot meet, its own log, JUnit reports and screenshots in
# test-artifacts/twice/1 and 2, no shared .pytest_cache); then each copy's serial phase alone, one after the other,
# as `make test` runs it. Fails if any phase of either copy failed; a copy's temporary folder is kept when it failed.
# Each temporary folder is made traversable (755, as /tmp is): run as root, the PostgreSQL tests' initdb runs as
# another user and must reach its data folder inside it.
TWICE := test-artifacts/twice
TWIN = TMPDIR=$$(cat $(TWICE)/$(1)/tmpdir) ECHO_SWARM_TEST_ARTIFACTS=$(CURDIR)/$(TWICE)/$(1)
test-twice: lint browser postgres
	@rm -rf $(TWICE) && mkdir -p $(TWICE)/1 $(TWICE)/2
	@status=0; \
	for k in 1 2; do mktemp -d "$${TMPDIR:-/tmp}/echo-swarm-twice-$$k.XXXXXX" > $(TWICE)/$$k/tmpdir || exit 1; \
	  chmod 755 "$$(cat $(TWICE)/$$k/tmpdir)"; done; \
	echo "the suite twice at once: logs and JUnit reports in $(TWICE)/1 and $(TWICE)/2"; \
	$(call TWIN,1) $(call PARALLEL_PHASE,$(TWICE)/1,-p no:cacheprovider) > $(TWICE)/1/parallel.log 2>&1 & one=$$!; \
	$(call TWIN,2) $(call PARALLEL_PHASE,$(TWICE)/2,-p no:cacheprovider) > $(TWICE)/2/parallel.log 2>&1 & two=$$!; \
	wait $$one; echo $$? > $(TWICE)/1/rc; wait $$two; echo $$? > $(TWICE)/2/rc; \
	for k in 1 2; do \
	  $(call TWIN,$$k) $(call SERIAL_PHASE,$(TWICE)/$$k,-p no:cacheprovider) > $(TWICE)/$$k/serial.log 2>&1; \
	  rc=$$?; [ $$rc = 5 ] && rc=0; echo $$rc >> $(TWICE)/$$k/rc; \
	done; \
	for k in 1 2; do \
	  for phase in parallel serial; do \
	    echo "copy $$k, $$phase phase: $$(tail -n 1 $(TWICE)/$$k/$$phase.log)"; \
	    grep -E '^(FAILED|ERROR) ' $(TWICE)/$$k/$$phase.log || true; \
	  done; \
	  if ! grep -qv '^0$$' $(TWICE)/$$k/rc; then rm -rf "$$(cat $(TWICE)/$$k/tmpdir)"; \
	  else status=1; echo "copy $$k failed: its temporary files are in $$(cat $(TWICE)/$$k/tmpdir)"; fi; \
	done; \
	exit $$status

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
