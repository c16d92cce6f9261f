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
	@# An AVX-512 host also runs the kernel-dependent tests on what AVX2-only users run: MKL's, ATen's and oneDNN's AVX2
	@# kernels and our C kernels built for x86-64-v3 (OMNIVOX_TEST_KERNEL_TARGET is read by tests/conftest.py only).
	@if $(BIN)/python -c 'from omnivox.native.kernel_build import cpu_flags; exit("avx512f" not in cpu_flags())'; then \
	  echo "second pass: the cpu_paths tests on the AVX2 kernels"; \
	  MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OMNIVOX_TEST_KERNEL_TARGET=x86-64-v3 \
	    $(BIN)/python -m pytest -q -rs -m cpu_paths -p no:cacheprovider \
	      $$(grep -rl --include='test_*.py' 'mark.cpu_paths' tests); \
	fi

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

proto: install
	$(BIN)/python protos/generate.py

bench: install
	$(BIN)/omnivox bench
