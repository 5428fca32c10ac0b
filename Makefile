# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
# TORCH_SPEC picks the torch build: the default is the CPU build this project is developed on;
# on a GPU machine, e.g. `make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
MODEL ?=
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install install-test serve test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install $(TORCH_SPEC)
	$(PIP) install -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -e '.[test]'
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

# Until the HTTP server lands (issue 4), `make serve` runs a short offline generation.
serve: install
	$(VENV)/bin/banyan generate $(if $(MODEL),--model $(MODEL),) --prompt "Once upon a time" --max-new-tokens 32

test: install-test
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache
