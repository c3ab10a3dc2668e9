# One-command setup: a virtual environment (created if missing) with the CPU build of torch.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.csattn-installed

.PHONY: setup demo test test-fast lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m csattn demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --timeout 900 --durations 15

# the fast lane: everything but the slow tests (spawned ranks, layers and models under the Triton interpreter,
# compiler runs); CI runs `test`
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --timeout 900 -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check csattn tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
