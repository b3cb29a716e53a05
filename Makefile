# The two set-up-and-run commands of the README:
#   make demo   creates .venv, builds and installs offload_adam (release), runs the main job
#               (DEMO_ARGS="--storage nvme --nvme-dir DIR" puts its optimizer state on an SSD)
#   make test   same set-up, then cargo test and pytest
#   (make generate runs examples/generate.py: the demo's model loaded from its checkpoint, answering sums;
#    make docs builds the documentation site into site/; CONTRIBUTING.md lists every target)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DEPS   := $(VENV)/.deps-installed

.PHONY: demo test test-slow test-isa install bench asv wheel lint clean generate docs

# bash, so that a step piped through a filter still fails when the step fails
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c

$(BIN)/python:
	@echo "== creating the virtual environment $(VENV) ($(PYTHON) -m venv)"
	$(PYTHON) -m venv $(VENV)
	@echo "== $(VENV) created"

# Once, and again when requirements-dev.txt changes (the stamp $(DEPS) is older): pip prints each
# package it downloads and installs (torch and its CUDA wheels are GBs: minutes the first time);
# the packages already there are not listed.
$(DEPS): requirements-dev.txt | $(BIN)/python
	@echo "== installing the dependencies of requirements-dev.txt into $(VENV) (the first time: several GB, minutes)"
	@$(BIN)/python -m pip install -q --upgrade pip
	@$(BIN)/python -m pip install -r requirements-dev.txt 2>&1 | { grep -v "^Requirement already satisfied" || true; }
	@touch $@
	@echo "== dependencies installed (stamp $@: skipped until requirements-dev.txt changes)"

# cargo decides what to rebuild, so this is quick when nothing changed; maturin's listing of the
# packages already installed (29 lines on every target) is kept in $(VENV)/maturin.log, shown
# only when the build fails.
install: $(DEPS)
	@echo "== building offload_adam (cargo build --release, then installed into $(VENV) by maturin)"
	@VIRTUAL_ENV=$(abspath $(VENV)) $(BIN)/maturin develop --release --quiet > $(VENV)/maturin.log 2>&1 \
	  || { cat $(VENV)/maturin.log; echo "== the build failed (log above, and in $(VENV)/maturin.log)"; exit 1; }
	@echo "== offload_adam built and installed ($$($(BIN)/python -c "import offload_adam; print(offload_adam.__version__)" 2>/dev/null || echo ?))"

demo: install
	@echo "== the main job: examples/train_gpt.py $(DEMO_ARGS)"
	$(BIN)/python examples/train_gpt.py $(DEMO_ARGS)

# Weights offloaded: the sums model make demo saved (trained first if it is not there), built empty
# and loaded from its checkpoint onto an SSD (runs/nvme; GEN_ARGS="--nvme-dir DIR --gpu-budget-gb X
# --placement auto ..."), answering 100 sums; on the CPU (device="cpu") without a GPU.
generate: runs/sums/model.safetensors
	$(BIN)/python examples/generate.py --sums runs/sums --storage nvme $(GEN_ARGS)

runs/sums/model.safetensors: | install
	$(BIN)/python examples/train_gpt.py --save runs/sums

test: install
	cargo test --quiet
	$(BIN)/python -m pytest -q

# The tests marked slow (fuzzing the checkpoint reader, minutes), which make test and CI skip.
test-slow: install
	$(BIN)/python -m pytest -q -m slow --run-slow

# The tests whose numbers come from the kernels (the Adam step, its codecs, the few-row matmul, the
# model decoded on it), once per SIMD path this CPU runs (OFFLOAD_ADAM_SIMD) and per thread count
# (1 and 2): a test that holds on one path only fails here (issue 36, point 1).
ISA_TESTS ?= tests/test_kernel.py tests/test_parity.py tests/test_lowbit.py tests/test_fp8.py tests/test_hostmatmul.py tests/test_native_dispatch.py tests/test_quantized.py tests/test_placement.py
test-isa: install
	@for simd in $$($(BIN)/python -c "from offload_adam import _native; print(' '.join(_native.simd_paths()))"); do \
	  for threads in 1 2; do \
	    echo "== OFFLOAD_ADAM_SIMD=$$simd OMP_NUM_THREADS=$$threads"; \
	    OFFLOAD_ADAM_SIMD=$$simd OMP_NUM_THREADS=$$threads $(BIN)/python -m pytest -q -p no:cacheprovider $(ISA_TESTS) || exit 1; \
	  done; \
	done

bench: install
	$(BIN)/python -m offload_adam bench

asv: install
	cd asv_bench && ../$(BIN)/asv machine --yes >/dev/null && ../$(BIN)/asv run --python=same --quick

# manylinux2014 (glibc 2.17), linked with zig (ziglang from requirements-dev.txt, found on PATH),
# so one abi3 wheel installs on RHEL/Rocky 8 as on new distributions; the tag is then checked, and
# dist/offload_adam-commit.json written beside it (the commit, a digest of the sources, the wheel's
# SHA-256: .ci/gpu_check.sh's preflight refuses a wheel built from other sources than its tree).
wheel: $(DEPS)
	rm -f dist/offload_adam-*.whl dist/offload_adam-commit.json
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/maturin build --release --zig --compatibility manylinux2014 --out dist
	$(BIN)/python .ci/check_wheel.py
	$(BIN)/python .ci/gpu_preflight.py stamp

# The documentation site (mkdocs-material; the API reference from the docstrings by mkdocstrings,
# which imports the package: hence install). Strict by default: a broken link or a missing page
# fails the build.
DOCS_FLAGS ?= --strict
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build $(DOCS_FLAGS) --site-dir site

lint: install
	$(BIN)/python -m mypy python/offload_adam
	cargo fmt --check
	cargo clippy --features python --tests -- -D warnings

clean:
	rm -rf $(VENV) target dist site asv_bench/.asv
