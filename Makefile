# Two entry points: `make serve` runs the service on the bundled demo model, `make test` runs the
# layer contracts, the type checker and the whole test suite. Each creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# pip prints setuptools' build warnings (an editable install's notice) even with -q.
PIP := PYTHONWARNINGS=ignore $(BIN)/pip install -q

$(BIN)/.venv:
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	touch $@

$(BIN)/.installed: pyproject.toml $(BIN)/.venv
	$(PIP) -e '.[server,mic]'
	touch $@

$(BIN)/.installed-test: pyproject.toml $(BIN)/.venv
	$(PIP) -e '.[test,reference]'
	touch $@

.PHONY: serve test test-fast layers types install clean-jit
install: $(BIN)/.installed

serve: $(BIN)/.installed
	$(BIN)/whistle-stream serve

test: $(BIN)/.installed-test layers types
	$(BIN)/python -m pytest -q -ra

test-fast: $(BIN)/.installed-test
	$(BIN)/python -m pytest -q -m 'not slow'

# import-linter's contracts (pyproject.toml): engine -> session core -> transport -> clients.
layers: $(BIN)/.installed-test
	$(BIN)/python tools/check_layers.py

# mypy over the files pyproject.toml's [tool.mypy] names: the service, the clients, the engine's API.
types: $(BIN)/.installed-test
	$(BIN)/mypy

# Numba's cache is dropped by whistle_stream/kernels/_cache.py whenever a kernel source changes;
# this removes it by hand.
clean-jit:
	find whistle_stream -name '*.nbi' -delete -o -name '*.nbc' -delete
