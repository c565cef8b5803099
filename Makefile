# Everything runs inside .venv, created on first use from the project's own files.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO := .demo

.PHONY: install install-flashinfer demo test test-gpu lint wheel-check tactics-bundle compile-check bench-prepare bench-kernel clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: any other spec may pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# FlashInfer, for the byte cross-checks of tests/layouts/test_flashinfer_oracle.py (CPU only).
# --no-deps: its declared dependencies pull CUDA-only packages (CUTLASS DSL, cuDNN, NCCL); these
# pinned ones (and its own packaging and tqdm specs) are what it needs to import on a machine without a GPU.
FLASHINFER := flashinfer-python==0.7.2.post1
FLASHINFER_DEPS := apache-tvm-ffi==0.1.15.post2 cuda-python==13.4.4 cuda-bindings==13.4.4 cuda-core==1.2.2 \
	cuda-pathfinder==1.9.1 einops==0.8.2 ninja==1.13.2 nvidia-ml-py==13.615.71 requests==2.34.2 tabulate==0.10.0 \
	'packaging>=24.2' tqdm
FLASHINFER_STAMP := $(VENV)/.flashinfer-0.7.2.post1

$(FLASHINFER_STAMP): $(STAMP)
	$(BIN)/pip install -q --no-deps $(FLASHINFER)
	$(BIN)/pip install -q $(FLASHINFER_DEPS)
	$(BIN)/python -c 'import flashinfer.fused_moe'
	touch $(FLASHINFER_STAMP)

install-flashinfer: $(FLASHINFER_STAMP)

# The main job on an embedded default: a synthetic gpt-oss checkpoint (real 2880 dims),
# prepared for trtllm-gen at TP 4, then verified byte for byte against the source.
demo: $(STAMP)
	rm -rf $(DEMO)
	$(BIN)/prepkit synth --out $(DEMO)/model --layers 2 --experts 4 --num-shards 3
	$(BIN)/prepkit prepare --src $(DEMO)/model --layout trtllm-gen --tp 4 --out $(DEMO)/trtllm-gen-tp4
	$(BIN)/prepkit verify $(DEMO)/trtllm-gen-tp4 --src $(DEMO)/model

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu"

test-gpu:
	$(PYTHON) -m pytest -q -m gpu tests

# mypy checks the packages that [tool.mypy] in pyproject.toml lists.
lint: $(STAMP)
	$(BIN)/ruff check prepkit tests benchmarks
	$(BIN)/ruff format --check prepkit tests benchmarks
	$(BIN)/mypy

# The built wheel in a fresh venv with its declared dependencies only, run from another folder.
wheel-check:
	PYTHON=$(PYTHON) .ci/wheel-check

# The slim tactics DB at the top (the wheel ships it in prepkit/data/), rewritten from the full history in data/.
tactics-bundle: $(STAMP)
	$(BIN)/python -m prepkit.tactics.bundle data/tactics-full.db tactics.db

# No GPU: compile gpt-oss-120b TP1's kernels for each SM12x target and activation policy, the
# defaults plus COMPILE_SAMPLE variants of each variant family, then the dense MX linear's defaults
# in each of COMPILE_DENSE's weight formats that pairs with the policy (mxfp4 activations: mxfp4
# weights only), with the venv's Triton and the ptxas/cuobjdump/nvdisasm its wheel ships; then the
# decode step's kernels (projections, attention) once per target. Every run goes; any failed default
# fails the target (MX policies must reach the native MMA).
COMPILE_ARCHES ?= sm120 sm121
COMPILE_ACTIVATIONS ?= bf16 mxfp8 mxfp4
COMPILE_SAMPLE ?= 1
COMPILE_DENSE ?= all

compile-check: $(STAMP)
	@rc=0; for arch in $(COMPILE_ARCHES); do for act in $(COMPILE_ACTIVATIONS); do \
		echo "== prepkit tune --arch $$arch --activations $$act --compile-only --sample $(COMPILE_SAMPLE) --dense-formats $(COMPILE_DENSE)"; \
		$(BIN)/prepkit tune --arch $$arch --model gpt-oss-120b --tp 1 --activations $$act \
			--compile-only --sample $(COMPILE_SAMPLE) --dense-formats $(COMPILE_DENSE) || rc=1; \
	done; \
	echo "== prepkit tune --arch $$arch --compile-only --decode --no-moe --dense-formats none"; \
	$(BIN)/prepkit tune --arch $$arch --model gpt-oss-120b --compile-only --decode --no-moe --dense-formats none || rc=1; \
	done; exit $$rc

bench-prepare: $(STAMP)
	$(BIN)/python benchmarks/bench_prepare.py

clean:
	rm -rf $(VENV) $(DEMO) .pytest_cache .ruff_cache .mypy_cache

# On a GPU machine (uses the python that has torch + triton there).
bench-kernel:
	$(PYTHON) benchmarks/bench_kernel.py
