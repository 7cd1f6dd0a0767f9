# sonar-kernels: every target does its own set-up, on a machine that has only Python and pip, in one of
# two virtual environments: .venv for the product (make demo, quickstart: torch, triton, the package with
# its [train] extra) and .venv-test for the test suite and the tools (make test, lint, bench: the [test]
# extra adds pytest, ruff, torchao, torchtitan, TRL, PEFT ...). Two, because transformers imports torchao
# whenever it is installed, and torchao prints load errors on a CPU: the product's environment has none.
PYTHON ?= python3
VENV ?= .venv
TEST_VENV ?= .venv-test
BIN := $(VENV)/bin
TEST_BIN := $(TEST_VENV)/bin
# torch 2.13.0 is the CPU build on the project's machines (a local wheel); on a CUDA machine, set
# TORCH_SPEC to the build you want. Triton 3.6 is what the GPU machine has; its interpreter (the CPU
# test lane) fails with numpy >= 2.4. Every other version tested is pinned in constraints.txt.
TORCH_SPEC ?= torch==2.13.0
TRITON_SPEC ?= triton==3.6.0
NUMPY_SPEC ?= numpy<2.4
# torchtitan, for tests/test_torchtitan.py and docs/frameworks.md's torchtitan block: installed --no-deps
# with what its modules import (spmd_types, tyro and tyro's docstring_parser and typeguard), without its
# trainer's dependencies (datasets, tensorboard, wandb, ...) and never another torch; versions in
# constraints.txt.
TORCHTITAN := torchtitan spmd_types tyro docstring_parser typeguard
STAMP := $(VENV)/.installed
TEST_STAMP := $(TEST_VENV)/.installed

.PHONY: install install-test test lint fmt kernel-report demo demo-short quickstart layer-check bench bench-gpu bench-gpu-rehearse gpu-wheels memory-real memory-real-check clean

$(STAMP): pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install "$(TORCH_SPEC)" "$(TRITON_SPEC)" "$(NUMPY_SPEC)"
	$(BIN)/python -m pip install -c constraints.txt -e ".[train]" "$(TORCH_SPEC)" "$(TRITON_SPEC)" "$(NUMPY_SPEC)"
	touch $(STAMP)

$(TEST_STAMP): pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(TEST_VENV)
	$(TEST_BIN)/python -m pip install "$(TORCH_SPEC)" "$(TRITON_SPEC)" "$(NUMPY_SPEC)"
	$(TEST_BIN)/python -m pip install -c constraints.txt -e ".[test,train]" "$(TORCH_SPEC)" "$(TRITON_SPEC)" \
		"$(NUMPY_SPEC)"
	$(TEST_BIN)/python -m pip install -c constraints.txt --no-deps $(TORCHTITAN)
	touch $(TEST_STAMP)

# The product: what `make demo` and `make quickstart` run with (pip install -e '.[train]').
install: $(STAMP)

# The product and the test tools, in .venv-test.
install-test: $(TEST_STAMP)

# The whole suite. Without CUDA, tests/conftest.py sets TRITON_INTERPRET=1 (the Triton interpreter on
# CPU); with CUDA the kernels run compiled on the GPU.
# TEST_WORKERS pytest-xdist processes (auto: one per core; 0 runs the tests in this process).
TEST_WORKERS ?= auto
test: install-test
	$(TEST_BIN)/python -m pytest -n $(TEST_WORKERS)

# ruff, and the import layers of the package (import-linter, contracts in pyproject.toml).
lint: install-test
	$(TEST_BIN)/ruff check .
	$(TEST_BIN)/ruff format --check .
	$(TEST_BIN)/lint-imports

fmt: install-test
	$(TEST_BIN)/ruff check --fix .
	$(TEST_BIN)/ruff format .

# Compile every kernel for sm_90a and sm_80 without a GPU; registers, spills, shared memory, wgmma; for the
# wgrad's bf16 variants at each sm_90 tile, "wgrad variants on sm_90a": CTAs per SM, the main loop's operand
# buffers and cp.async.wait_group depth, the epilogue's SASS instructions per element. Then every variant
# the GPU benchmark compiles, in both AdamW arithmetics (bench/gpu_bench.py --dry-run).
kernel-report: install
	env -u TRITON_INTERPRET $(BIN)/python tools/kernel_report.py
	for a in fp64 fp32; do env -u TRITON_INTERPRET $(BIN)/python bench/gpu_bench.py --dry-run --compile-times \
		--arithmetic $$a --out runs/kernel-report/gpu-bench-$$a.json > /dev/null \
		&& sed -n '/^## Compilations/,$$p' runs/kernel-report/gpu-bench-$$a.md || exit 1; done

# The peak memory of one training step at the real sizes (OLMoE-1B-7B, Granite-3.1-3B-A800M, Qwen3-30B-A3B,
# full depth, one GPU, FSDP2 and EP x FSDP2-dense over 4 and 8 ranks, every arm, checkpointing on and off),
# traced by torch's MemTracker under FakeTensorMode on this CPU: nothing allocated, no kernel run
# (bench/memory_real.py); writes runs/memory-real/report.json. memory-real-check: the one-GPU rows at 1 and
# 2 layers, fake against real tensors (where they fit this machine); writes runs/memory-real/check.json.
memory-real: install
	env -u TRITON_INTERPRET $(BIN)/python bench/memory_real.py

memory-real-check: install
	env -u TRITON_INTERPRET $(BIN)/python bench/memory_real.py --check --layers 1 2 --world-sizes 1 \
		--out runs/memory-real/check.json

# The main job: sonar-train's default preset (tiny OLMoE on the Python docs), standard vs sonar side by
# side over 3 seeds; writes runs/tiny-olmoe/report.json and report.png (runs/tiny-olmoe-2/ ... when taken).
# On CPU the experts run the torch backend. Each finished run is kept: after Ctrl-C,
# `.venv/bin/sonar-train --resume runs/tiny-olmoe` finishes it (docs/sonar-train.md).
demo: install
	@echo "make demo: about 5 minutes on a quiet 2-core CPU (316 s at e601e88), longer on a busy one;" \
		"Ctrl-C keeps the finished runs (sonar-train --resume); 'make demo-short' is a first look in under a minute"
	$(BIN)/sonar-train

# The same comparison, smaller (2 seeds x 40 steps of a 2-layer tiny OLMoE, fewer held-out batches and
# timing rounds): every verdict of `make demo`, in under a minute on a quiet 2-core CPU (36 s at e601e88).
demo-short: install
	$(BIN)/sonar-train --seeds 2 --steps 40 --layers 2 --heldout-batches 8 --timing-rounds 10 \
		--name tiny-olmoe-short

# One expert-MLP layer's training step by each provider side by side (pytest-benchmark; on CPU the torch
# backend at sonar-train's tiny-olmoe layer and a larger one; the Triton interpreter is never timed): sonar,
# sonar-unfused, the paper's method and its per-expert ablation, standard with torch's fused AdamW
# (standard-fused, the baseline) and with its default flags (standard). Median and p10-p90 per row, every
# ratio provider / standard-fused (below 1 is better), sonar's step time and the share of the layer's
# expert-gradient bytes its peak saves, and a last line saying whether the machine was quiet enough to
# compare the times (bench/README.md). The JSON (per row provider, phase, shape, peak and expert-gradient
# bytes, device, versions, commit, p10/p90) goes to runs/bench/.
bench: install-test
	mkdir -p runs/bench
	$(TEST_BIN)/python -m pytest bench/test_layer.py -p no:cacheprovider --benchmark-only \
		--benchmark-json=runs/bench/layer.json

# On one CUDA GPU whose Python already has torch and triton (no venv, no package index): bench/gpu_run.sh
# installs the wheels of .whl/ (make gpu-wheels, beforehand, where an index is reachable) and runs
# bench/gpu_bench.py's sections under a deadline, writing GPU_BENCH_OUT and its .md after every unit
# (bench/README.md). Without CUDA it says so: `make bench-gpu-rehearse` runs the CPU rehearsal.
GPU_BENCH_OUT ?= runs/bench-gpu/gpu_bench.json
GPU_BENCH_DEADLINE ?= 420
bench-gpu:
	@if $(PYTHON) -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then \
		bash bench/gpu_run.sh $(GPU_BENCH_OUT) $(GPU_BENCH_DEADLINE); \
	else \
		echo "make bench-gpu: $(PYTHON) has no CUDA torch; on a CUDA machine it runs bench/gpu_run.sh," \
			"here 'make bench-gpu-rehearse' runs the CPU rehearsal of the same script"; exit 1; \
	fi

# The wheels bench/gpu_run.sh installs on the GPU machine (bench/gpu_wheels.txt), for its Python 3.12.
gpu-wheels:
	mkdir -p .whl
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl -r bench/gpu_wheels.txt

# bench/gpu_bench.py --rehearse: every section at tiny shapes on the CPU (tests/test_gpu_bench.py runs it).
bench-gpu-rehearse: install
	$(BIN)/python bench/gpu_bench.py --rehearse --out runs/bench-gpu/rehearsal.json

# README's quick start (a tiny transformers OLMoE with experts_implementation="sonar" and SonarAdamW, three
# steps, saved with save_pretrained), run as written from runs/quickstart/: seconds, most of it importing.
quickstart: install
	mkdir -p runs/quickstart
	cd runs/quickstart && $(abspath $(BIN))/python $(CURDIR)/examples/quickstart.py

# One SonarExperts layer under the Triton interpreter (the kernels' CPU lane, a few minutes): the forward vs
# float64, the backward, ExpertAdamW steps (fused == split bitwise).
layer-check: install
	$(BIN)/python examples/layer_check.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
