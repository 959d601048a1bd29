# One entry point for a fresh machine: `make test` installs, starts the real services, runs the suite.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-parallel prebuild prebuild-images test-fast bench soak install services-up services-down services-status lint typecheck clean

test: prebuild install services-up prebuild-images
	$(PY) -m pytest

# The same tests, the Spark tests beside the others on a stack of their own (scripts/test_suite.py):
# ~24 min instead of ~28-30 on a fresh 2-core machine, but the machine is saturated, and two tests
# with tight timing failed in five runs (one since fixed); `make test` stays serial until all hold.
test-parallel: prebuild install services-up prebuild-images
	$(PY) scripts/test_suite.py

prebuild-images: install services-up
	@($(IDLE) $(PY) scripts/image.py build sidecar && \
	  $(IDLE) $(PY) scripts/image.py build reconcile) > .local/prebuild-images.log 2>&1 &

# What the chart's tests need, built in the background while the rest installs, starts and runs
# (the chart's tests that need them come last, and wait for them: a lock each): the Go builds
# (helm, then promtool; kube-apiserver and etcd) from the start, the two images (minutes each)
# once the services are up. At the lowest priority (CPU; disk too where the I/O scheduler
# honours it): they take only what the tests leave idle.
IDLE := nice -n 19 $(shell command -v ionice >/dev/null && echo ionice -c 3)
prebuild:
	@mkdir -p .local
	@$(IDLE) $(PYTHON) scripts/kube.py build > .local/prebuild-kube.log 2>&1 &
	@($(IDLE) $(PYTHON) scripts/services.py helm && \
	  $(IDLE) $(PYTHON) scripts/services.py promtool) > .local/prebuild-go-tools.log 2>&1 &

# Unit tests only: no services needed.
test-fast: install
	$(PY) -m pytest -m unit

# The sidecar end to end on the local stack: sample producer, live progress, Ctrl-C stops.
run: install
	$(PY) scripts/demo.py

# All six, one after the other (never two at once: they share the machine's cores): ~26 min on 2 cores.
bench: install services-up
	$(PY) -m bench.publish
	$(PY) -m bench.checker
	$(PY) -m bench.relay
	$(PY) -m bench.spanning
	$(PY) -m bench.latency
	$(PY) -m bench.reconcile

# Chaos soak of the relay on a stack of its own (other ports, .local/soak): scripts/soak/.
soak: install
	$(PY) -m scripts.soak

install: $(STAMP)

# PIP_CONSTRAINT reaches the isolated environments that build sdists (pyspark is one): -c does
# not, and they took the newest setuptools, whatever it broke.
$(STAMP): pyproject.toml constraints.txt
	@# pip, not the interpreter: a venv whose creation failed (no python3-venv) has the latter
	$(PY) -m pip --version >/dev/null 2>&1 || $(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install -q -c constraints.txt setuptools wheel
	PIP_CONSTRAINT=$(abspath constraints.txt) $(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

services-up: install
	$(PY) scripts/services.py up

services-down:
	$(PYTHON) scripts/services.py down

services-status:
	$(PYTHON) scripts/services.py status

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install
	$(VENV)/bin/mypy

clean: services-down
	rm -rf .local $(VENV)
