# sonar-kernels: every target does its own set-up in .venv, on a machine that has only Python and pip.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch 2.13.0 is the CPU build on the project's machines (a local wheel); on a CUDA machine, set
# TORCH_SPEC to the build you want. Triton 3.6 is what the GPU machine has; its interpreter (the CPU
# test lane) fails with numpy >= 2.4.
TORCH_SPEC ?= torch==2.13.0
TRITON_SPEC ?= triton==3.6.0
NUMPY_SPEC ?= numpy<2.4
# torchtitan, for tests/test_torchtitan.py and docs/frameworks.md's torchtitan block: the release
# sonar_kernels.integrations.torchtitan is tested with, installed --no-deps with what its modules import
# (spmd_types, tyro and tyro's docstring_parser and typeguard), without its trainer's dependencies
# (datasets, tensorboard, wandb, ...) and never another torch.
TORCHTITAN_VERSION ?= 0.3.0
STAMP := $(VENV)/.installed

.PHONY: install test lint fmt kernel-report demo quickstart bench bench-gpu bench-gpu-rehearse gpu-wheels memory-real memory-real-check clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install "$(TORCH_SPEC)" "$(TRITON_SPEC)" "$(NUMPY_SPEC)"
	$(BIN)/python -m pip install -e ".[test,train]" "$(TORCH_SPEC)" "$(TRITON_SPEC)" "$(NUMPY_SPEC)"
	$(BIN)/python -m pip install --no-deps "torchtitan==$(TORCHTITAN_VERSION)" "spmd_types==0.2.3" "tyro==1.0.17" \
		"docstring_parser==0.18.0" "typeguard==4.6.1"
	touch $(STAMP)

install: $(STAMP)

# The whole suite. Without CUDA, tests/conftest.py sets TRITON_INTERPRET=1 (the Triton interpreter on
# CPU); with CUDA the kernels run compiled on the GPU.
# TEST_WORKERS pytest-xdist processes (auto: one per core; 0 runs the tests in this process).
TEST_WORKERS ?= auto
test: install
	$(BIN)/python -m pytest -n $(TEST_WORKERS)

# ruff, and the import layers of the package (import-linter, contracts in pyproject.toml).
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

fmt: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Compile every kernel for sm_90a and sm_80 without a GPU; registers, spills, shared memory, wgmma. Then
# every variant the GPU benchmark compiles, in both AdamW arithmetics (bench/gpu_bench.py --dry-run).
kernel-report: install
	env -u TRITON_INTERPRET $(BIN)/python tools/kernel_report.py
	for a in fp64 fp32; do env -u TRITON_INTERPRET $(BIN)/python bench/gpu_bench.py --dry-run --compile-times \
		--arithmetic $$a --out runs/kernel-report/gpu-bench-$$a.json > /dev/null \
		&& sed -n '/^## Compilations/,$$p' runs/kernel-report/gpu-bench-$$a.md || exit 1; done

# The peak memory of one training step at the real sizes (OLMoE-1B-7B, Granite-3.1-3B-A800M, Qwen3-30B-A3B,
# full depth, one GPU and FSDP2 over 4 and 8 ranks, every arm, checkpointing on and off), traced by torch's
# MemTracker under FakeTensorMode on this CPU: nothing allocated, no kernel run (bench/memory_real.py);
# writes runs/memory-real/report.json. memory-real-check: the same rows at 1 and 2 layers, fake against
# real tensors (where they fit this machine); writes runs/memory-real/check.json.
memory-real: install
	env -u TRITON_INTERPRET $(BIN)/python bench/memory_real.py

memory-real-check: install
	env -u TRITON_INTERPRET $(BIN)/python bench/memory_real.py --check --layers 1 2 \
		--out runs/memory-real/check.json

# The main job: sonar-train's default preset (tiny OLMoE on the Python docs), standard vs sonar side by
# side over 3 seeds; writes runs/tiny-olmoe/report.json and report.png (runs/tiny-olmoe-2/ ... when taken).
# On CPU the experts run the torch backend.
demo: install
	$(BIN)/sonar-train

# One expert-MLP layer's training step by each provider side by side (pytest-benchmark; on CPU the torch
# backend at sonar-train's tiny-olmoe layer and a larger one; the Triton interpreter is never timed): sonar,
# sonar-unfused, the paper's method and its per-expert ablation, standard with torch's fused AdamW
# (standard-fused, the baseline) and with its default flags (standard). Median and p10-p90 per row, every
# ratio provider / standard-fused (below 1 is better), sonar's step time and the share of the layer's
# expert-gradient bytes its peak saves, and a last line saying whether the machine was quiet enough to
# compare the times (bench/README.md). The JSON (per row provider, phase, shape, peak and expert-gradient
# bytes, device, versions, commit, p10/p90) goes to runs/bench/.
bench: install
	mkdir -p runs/bench
	$(BIN)/python -m pytest bench/test_layer.py -p no:cacheprovider --benchmark-only \
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

# One SonarExperts layer under the Triton interpreter: the forward vs float64, the backward, ExpertAdamW
# steps (fused == split bitwise).
quickstart: install
	$(BIN)/python examples/quickstart.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
