# Two entry points (see README): `make serve` runs the service on the embedded default, `make test` passes the tests.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install serve test lint proto bench

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

serve: install
	$(BIN)/omnivox serve --demo

test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -rs --durations=25

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

proto: install
	$(BIN)/python protos/generate.py

bench: install
	$(BIN)/omnivox bench
