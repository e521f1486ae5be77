# `make demo` and `make test` work on a fresh machine: each creates .venv if missing,
# installs the pinned dependencies and the package, then runs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml requirements.lock
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements.lock
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	rm -rf runs/demo
	$(BIN)/linattn train --config configs/demo.toml --out runs/demo
	$(BIN)/linattn generate --ckpt runs/demo --prompt "ROMEO." --max-new-tokens 300 --seed 0

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	$(BIN)/linattn bench attention --out results/bench

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache runs
