"""The benchmark providers (bench/providers.py) all compute the same training step."""

import sys
from pathlib import Path

import pytest
import torch
from numerics import assert_close

import sonar_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import providers

pytest.importorskip("transformers", minversion="5.13")


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_every_provider_takes_the_same_two_steps(routing, backend, device):
    # The torch backend is what `make bench` times on the CPU; the Triton one runs here as a correctness
    # smoke (under the interpreter without a GPU).
    inputs = providers.make_inputs(providers.SHAPES["cpu-tiny"], torch.float32, device, routing=routing)
    fused = providers.fused_adamw_runs(inputs.gate_up_proj)
    assert fused  # torch has a fused AdamW for fp32 on the CPU and on CUDA
    results, steps = {}, {}
    for name in providers.PROVIDERS:
        step = providers.build(name, inputs, backend=backend)
        for _ in range(2):
            step.run()
        results[name], steps[name] = step.weights(), step
        assert all(p.grad is None for p in step.params), name  # updated, or released by zero_grad
    # The AdamW flags each provider applies: torch's fused AdamW where it runs, the default flags for
    # standard.
    for name in ("sonar-unfused", "standard-fused"):
        assert steps[name].optimizer.defaults["fused"] is True, name
    assert steps["standard"].optimizer.defaults["fused"] is None
    assert steps["standard"].optimizer.defaults["foreach"] is None
    assert isinstance(steps["sonar"].optimizer, sonar_kernels.ExpertAdamW)
    assert all(state["step"].device == inputs.x.device for state in steps["paper-inbwd"].optimizer.values())
    reference = results["sonar-unfused"]  # the expert MLP's gradient, then torch.optim.AdamW(fused=True)
    moved = (reference[0] - inputs.gate_up_proj).norm() / inputs.gate_up_proj.norm()
    assert moved > 1e-4  # two steps changed the weights
    # Fused and non-fused AdamW, the sonar expert MLP's gradients and transformers': within fp32 tolerance.
    for name, weights in results.items():
        for w, ref, what in zip(weights, reference, ("gate_up_proj", "down_proj"), strict=True):
            assert_close(w, ref, torch.float32, what=f"{name} {what}")
    # The paper's method applies the same torch AdamW flags to the same gradient: identical bits (per
    # expert too: at cpu-tiny each expert slice is a whole number of the fused kernel's vectors).
    for name in ("paper-inbwd", "per-expert-inbwd"):
        assert all(torch.equal(a, b) for a, b in zip(results[name], reference, strict=True)), name


def test_expert_grad_bytes_are_those_of_the_layers_gradients():
    shape = providers.SHAPES["cpu-tiny"]
    inputs = providers.make_inputs(shape, torch.float32, "cpu")
    step = providers.build("standard", inputs)
    inputs.backward(step.phase("forward")())
    assert shape.expert_grad_bytes(torch.float32) == sum(
        p.grad.numel() * p.grad.element_size() for p in step.params
    )
    assert shape.expert_grad_bytes(torch.bfloat16) == 3 * shape.E * shape.H * shape.I * 2


def test_forward_and_forward_backward_phases_match_the_reference_and_keep_no_gradient(device):
    from sonar_kernels import reference

    inputs = providers.make_inputs(providers.SHAPES["cpu-tiny"], torch.float32, device)
    expected = reference.moe_mlp(
        inputs.x, inputs.index, inputs.weights, inputs.gate_up_proj, inputs.down_proj
    )
    # The gradients forward+backward computes (it drops them): dX, d routing weights, dW1, dW2.
    leaves = (inputs.x, inputs.weights, inputs.gate_up_proj, inputs.down_proj)
    leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    reference.moe_mlp(leaves[0], inputs.index, *leaves[1:]).backward(inputs.grad_out.double())
    for name in providers.phase_providers("forward"):
        step = providers.build(name, inputs, backend="triton")
        assert_close(step.phase("forward")(), expected, torch.float32, what=name)
        seen = {}
        handles = [
            t.register_hook(lambda g, i=i, seen=seen: seen.__setitem__(i, g.clone()))
            for i, t in enumerate((inputs.x, inputs.weights, *step.params))
        ]
        step.phase("forward+backward")()
        for handle in handles:
            handle.remove()
        assert sorted(seen) == [0, 1, 2, 3], name
        for i, leaf in enumerate(leaves):
            assert_close(seen[i], leaf.grad, torch.float32, what=f"{name} gradient {i}")
        assert all(p.grad is None for p in step.params) and inputs.x.grad is None, name
        assert all(
            torch.equal(a, b)
            for a, b in zip(step.weights(), (inputs.gate_up_proj, inputs.down_proj), strict=True)
        )
    assert providers.phase_providers("step") == providers.PROVIDERS
    with pytest.raises(ValueError, match="is measured for"):
        providers.build("sonar", inputs).phase("forward")
    with pytest.raises(ValueError, match="phase must be one of"):
        providers.phase_providers("update")


def test_shapes_and_flops():
    import table

    assert table.BASELINE == providers.BASELINE == "standard-fused" and table.SONAR in providers.PROVIDERS
    shape = providers.SHAPES["olmoe-1b-7b"]
    assert shape == (4096, 2048, 1024, 64, 8)
    assert shape.flops(backward=False) == 6 * 4096 * 8 * 2048 * 1024
    assert shape.flops() == 3 * shape.flops(backward=False)
    with pytest.raises(ValueError, match="provider must be one of"):
        providers.build("nope", providers.make_inputs(providers.SHAPES["cpu-tiny"], torch.float32, "cpu"))
    with pytest.raises(ValueError, match="routing"):
        providers.make_inputs(providers.SHAPES["cpu-tiny"], torch.float32, "cpu", routing="zipf")


def test_layer_benchmark_runs_and_prints_the_side_by_side_table(tmp_path):
    import json
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    # A pytest of its own: not this run's options, nor its pytest-xdist worker's variables (pytest-benchmark
    # turns itself off under xdist).
    env = {
        k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS" and not k.startswith("PYTEST_XDIST")
    } | {"SONAR_BENCH_SHAPES": "cpu-tiny"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", str(root / "bench" / "test_layer.py"), "-q", "-p", "no:cacheprovider",
         "-k", "uniform and (step-sonar-cpu or standard-fused-cpu)", "--benchmark-only",
         f"--benchmark-json={tmp_path / 'layer.json'}"],
        cwd=root, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "providers side by side" in done.stdout
    report = json.loads((tmp_path / "layer.json").read_text())
    rows = {(b["extra_info"]["phase"], b["extra_info"]["provider"]): b for b in report["benchmarks"]}
    assert set(rows) == {("step", "sonar"), *((p, "standard-fused") for p in providers.PHASES)}
    # Each row records what the memory goal is read from, and where it ran.
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()  # fmt: skip
    shape = providers.SHAPES["cpu-tiny"]
    for (phase, provider), row in rows.items():
        info = row["extra_info"]
        assert info["provider"] == provider and info["phase"] == phase and info["shape"] == "cpu-tiny"
        assert tuple(info[k] for k in shape._fields) == tuple(shape)
        # Measured, not asserted: on the CPU the torch backend runs (its memory against the baseline's is
        # a benchmark result; tests/test_memory.py checks the fused epilogue's saving).
        assert info["peak_bytes"] > 0 and info["expert_grad_bytes"] == shape.expert_grad_bytes(torch.float32)
        assert info["device"] == ("cuda" if torch.cuda.is_available() else "cpu") and info["device_name"]
        assert info["versions"]["torch"] == torch.__version__ and info["versions"]["transformers"]
        assert info["commit"] == (commit or None) and info["dirty"] in (True, False, None)
        assert info["backend"] == ("triton" if torch.cuda.is_available() else "torch")
        assert {"p10", "p90", "busy"} <= set(row["stats"])
    assert report["commit"] == rows["step", "sonar"]["extra_info"]["commit"] and "commit_info" in report
    assert "cpu-tiny (T 16, H 32, I 16, E 4, top_k 2), uniform routing, training step" in done.stdout
    assert "cpu-tiny (T 16, H 32, I 16, E 4, top_k 2), uniform routing, forward+backward" in done.stdout
    # One ratio convention, the spread beside every median, sonar's goals, the verdict on the load.
    assert "ratios are provider / standard-fused: below 1 is better" in done.stdout
    assert "p10-p90 ms" in done.stdout
    assert "sonar / standard-fused: step time" in done.stdout
    assert "sonar's peak saves" in done.stdout and "of the layer's expert-gradient bytes" in done.stdout
    assert "quiet machine (" in done.stdout or "BUSY MACHINE (" in done.stdout


def test_standard_falls_back_to_the_reference_experts_without_transformers(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_transformers(name, *args, **kwargs):
        if name.startswith("transformers"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    inputs = providers.make_inputs(providers.SHAPES["cpu-tiny"], torch.float32, "cpu")
    with_transformers = providers.build("standard", inputs)
    monkeypatch.setattr(builtins, "__import__", no_transformers)
    without = providers.build("standard", inputs)
    assert "OlmoeExperts" in with_transformers.experts and "transformers not installed" in without.experts
    for step in (with_transformers, without):
        step.run()
    for a, b in zip(without.weights(), with_transformers.weights(), strict=True):
        assert_close(a, b, torch.float32)


def _labels(run, w1, w2) -> list[str]:
    import kernel_times

    with kernel_times.timed_kernels(False, w1, w2) as log:
        run()
    return [entry[0] for entry in log]


def test_kernel_timing_labels_each_launch_by_what_it_computes():
    import sonar_kernels

    inputs = providers.make_inputs(providers.SHAPES["cpu-tiny"], torch.float32, "cpu")
    forward = ["routing histogram", "routing scan", "routing scatter", "up", "down", "combine"]

    def step(fused_epilogue, which):
        w1, w2 = (torch.nn.Parameter(t.clone()) for t in (inputs.gate_up_proj, inputs.down_proj))
        # Kept alive until the launches are labelled: the in-backward hooks hold the optimizer weakly.
        _optimizer = sonar_kernels.ExpertAdamW([(w1, w2)[i] for i in which], fused_epilogue=fused_epilogue)

        def run():
            inputs.backward(
                sonar_kernels.moe_mlp(inputs.x, inputs.index, inputs.weights, w1, w2, backend="triton")
            )

        return _labels(run, w1, w2)

    # After dHpre: the update bound's magnitudes pass and every update's flag (ops/triton_backend/update_bound.py).
    backward_middle = ["update bound", "update flags", "routing-weight grad", "dgrad dX", "combine dX"]
    # Both fused; only W1 fused (W2's gradient plain); both on the split path. The layer's core (dHpre,
    # the routing-weight gradient, dX) runs first, then each weight's wgrad job; an updated weight's wgrad
    # runs once its whole gradient is known, in the pre-hook of its AccumulateGrad node.
    # Each update: its check pass, the update's begin (skip, step, scalars), the update, its end (telemetry).
    assert step(True, (0, 1)) == [*forward, "dgrad G", *backward_middle, "wgrad dW1 check", "update begin",
                                  "wgrad dW1 adamw", "update end", "wgrad dW2 check", "update begin",
                                  "wgrad dW2 adamw", "update end"]  # fmt: skip
    assert step(True, (0,)) == [*forward, "dgrad G", *backward_middle, "wgrad dW2 store", "wgrad dW1 check",
                                "update begin", "wgrad dW1 adamw", "update end"]  # fmt: skip
    # The split path decides the skip with the check pass too (its chunks: here one, the whole tensor).
    assert step(False, (0, 1)) == [*forward, "dgrad G", *backward_middle, "wgrad dW1 check", "update begin",
                                   "wgrad dW1 store", "adamw dW1", "update end", "wgrad dW2 check",
                                   "update begin", "wgrad dW2 store", "adamw dW2", "update end"]  # fmt: skip
    # Per step, the seconds of each label; an entry of None separates steps.
    import kernel_times

    log = [("up", 0.0, 2.0), ("down", 0.0, 1.0), None, ("up", 0.0, 4.0), ("down", 0.0, 3.0), None,
           ("up", 0.0, 3.0), ("up", 0.0, 5.0)]  # fmt: skip
    assert kernel_times.per_kernel_seconds(log) == {"up": 4.0, "down": 2.0}
