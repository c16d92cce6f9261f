# Two entry points (see README): `make serve` runs the service on the embedded default, `make test` passes the tests.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# The suite runs on TEST_WORKERS pytest-xdist processes, a test file per worker at a time (module fixtures are built
# once). Two, for the 2-core machines CI and sessions get: most of a test's time is one Python thread (imports, server
# start-up, gRPC, tokenising), and tests/conftest.py gives each in-process engine one torch thread. 0 runs it serially.
TEST_WORKERS ?= 2

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
	$(BIN)/python -m pytest -q -rs --durations=25 -n $(TEST_WORKERS) --dist loadfile
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
