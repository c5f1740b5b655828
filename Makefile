# Two entry points: `make serve` runs the service on the embedded demo model,
# `make test` runs the whole test suite. Each creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

$(BIN)/.installed-reference: $(BIN)/.installed
	$(BIN)/pip install -q -e '.[test,reference]'
	touch $@

.PHONY: serve test test-fast install clean-jit
install: $(BIN)/.installed

serve: $(BIN)/.installed
	$(BIN)/whistle-stream serve

test: $(BIN)/.installed-reference
	$(BIN)/python -m pytest -q -ra

test-fast: $(BIN)/.installed-reference
	$(BIN)/python -m pytest -q -m 'not slow'

# Numba's on-disk cache is keyed by each kernel's own source file: a kernel inlined from another
# module (kernels._exp_neg) does not invalidate its callers. Run this after editing kernels.
clean-jit:
	find whistle_stream -name '*.nbi' -delete -o -name '*.nbc' -delete
