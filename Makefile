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

.PHONY: install test lint fmt kernel-report demo quickstart bench bench-gpu clean

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

# Compile every kernel for sm_90a and sm_80 without a GPU; registers, spills, shared memory, wgmma.
kernel-report: install
	env -u TRITON_INTERPRET $(BIN)/python tools/kernel_report.py

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

# On one CUDA GPU: correctness at the real shapes, then every provider at the OLMoE-1B-7B and Granite
# layer shapes against torch.mm and the copy bandwidth; writes bench/results/<date>-<gpu>.json and .md.
bench-gpu: install
	$(BIN)/python bench/gpu_bench.py

# One SonarExperts layer under the Triton interpreter: the forward vs float64, the backward, ExpertAdamW
# steps (fused == split bitwise).
quickstart: install
	$(BIN)/python examples/quickstart.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
