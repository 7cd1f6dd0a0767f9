"""sonar-train: the command line, its data handling and errors, and a tiny end-to-end run."""

import json
import subprocess
import sys

import pytest
import torch

from sonar_kernels import train

pytest.importorskip("transformers", minversion="5.13")


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    """Each test runs in its own folder: a run without --out writes runs/ there, never in the checkout."""
    monkeypatch.chdir(tmp_path)


def _error(capsys, argv):
    code = train.main(argv)
    return code, capsys.readouterr().err


def test_missing_empty_and_non_utf8_data_are_refused_with_exit_code_2(tmp_path, capsys):
    code, err = _error(capsys, ["--data", str(tmp_path / "nope.txt")])
    assert code == 2 and "no such file" in err and "nope.txt" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    code, err = _error(capsys, ["--data", str(empty)])
    assert code == 2 and "holds no text" in err
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("café crème".encode("latin-1"))
    code, err = _error(capsys, ["--data", str(latin)])
    assert code == 2 and "not UTF-8" in err
    bad_jsonl = tmp_path / "data.jsonl"
    bad_jsonl.write_text('{"text": "a"}\n{"body": "b"}\n')
    code, err = _error(capsys, ["--data", str(bad_jsonl)])
    assert code == 2 and 'line 2 has no "text"' in err
    code, err = _error(capsys, ["--data", str(tmp_path)])
    assert code == 2 and "a folder; give a text or .jsonl file" in err
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    code, err = _error(capsys, ["--data", str(short)])
    assert code == 2 and "fewer than --seq-len" in err
    # None of these reserved a run folder (it is created once the data and the model are good).
    assert not (tmp_path / "runs").exists()


def test_unknown_preset_and_bad_numbers_exit_2_from_the_command_line():
    for argv, words in (
        (["--preset", "gpt-5"], "invalid choice: 'gpt-5'"),
        (["--steps", "0"], "--steps must be >= 1"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "sonar_kernels.train", *argv], capture_output=True, text=True, check=False
        )
        assert done.returncode == 2, done.stderr
        assert words in done.stderr


def test_data_sources(tmp_path):
    text = train.default_text()
    assert 400_000 < len(text.encode()) < 600_000 and 'The "assert" statement' in text  # pydoc_data.topics
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text('{"text": "first"}\n\n{"text": "second", "id": 2}\n')
    assert train.load_text(str(jsonl)) == "first\n\nsecond"
    data = train.ByteData("abcdefghij" * 50, 16, 3, seed=0)
    assert data.batch(4).shape == (3, 16) and torch.equal(data.batch(4), data.batch(4))
    assert not torch.equal(data.batch(4), data.batch(5))
    assert len(data.train) + len(data.heldout) == 500 and len(data.heldout) == 50
    assert all(b.shape[1] == 16 for b in data.heldout_batches(8))


def test_the_timing_pass_times_the_arms_side_by_side_in_rotated_order(tmp_path, capsys, monkeypatch):
    from sonar_kernels.train import arms as arms_module

    order = []
    step = arms_module.train_step

    def recording(arm, tokens, max_grad_norm):
        order.append(arm.name)
        return step(arm, tokens, max_grad_norm)

    monkeypatch.setattr(arms_module, "train_step", recording)
    argv = ["--steps", "2", "--seeds", "1", "--layers", "1", "--batch-size", "2", "--seq-len", "32",
            "--heldout-batches", "1", "--out", str(tmp_path), "--name", "t", "--quiet", "--backend", "torch",
            "--no-memory", "--timing-rounds", "10"]  # fmt: skip
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    names = ["standard", "sonar", "standard-dense-clip"]
    rounds = [order[-45:][3 * r : 3 * r + 3] for r in range(15)]  # 5 warm-up rounds, then 10
    assert order[:-45] == ["standard"] * 2 + ["sonar"] * 2 + ["standard-dense-clip"] * 2  # the training runs
    assert rounds == [names[r % 3 :] + names[: r % 3] for r in range(15)]
    report = json.loads((tmp_path / "t" / "report.json").read_text())
    for arm in report["arms"].values():
        assert arm["step_time"]["samples"] == 10 and arm["training_step_time"]["samples"] == 0
    standard, sonar = (report["arms"][n]["step_time"]["median_s"] for n in ("standard", "sonar"))
    assert report["speedup"] == pytest.approx(standard / sonar, rel=1e-12)
    assert "10 rounds side by side" in report["timing"] and "10 rounds side by side" in out


def test_tiny_run_writes_the_report_and_the_sonar_arm_equals_its_control_bitwise(tmp_path, capfd):
    argv = ["--steps", "4", "--seeds", "2", "--layers", "1", "--batch-size", "2", "--seq-len", "32",
            "--heldout-batches", "2", "--out", str(tmp_path), "--name", "t", "--quiet", "--backend", "torch",
            "--timing-rounds", "0"]  # fmt: skip
    assert train.main(argv) == 0
    out, err = capfd.readouterr()  # file descriptors: transformers' logger writes to the real stderr
    assert "use_cache" not in err and err == "", err  # --quiet: nothing on stderr
    report = json.loads((tmp_path / "t" / "report.json").read_text())
    assert (tmp_path / "t" / "report.png").stat().st_size > 10_000
    assert report["sonar_equals_control_bitwise"] is True
    assert report["seeds"] == [0, 1] and report["heldout_batches"] == 2
    # Every expert tensor (2 for one layer) updated once per step and seed, all in the backward: counted.
    assert report["expert_tensors"] == 2
    assert report["sonar_expert_updates_in_backward"] == report["sonar_expert_updates_expected"] == 2 * 4 * 2
    assert report["sonar_expert_updates_in_step"] == 0
    assert set(report["arms"]) == {"standard", "sonar", "standard-dense-clip"}
    for name, arm in report["arms"].items():
        assert arm["seeds"] == ([0] if name == "standard-dense-clip" else [0, 1])
        assert len(arm["train_losses"]) == len(arm["seeds"]) == len(arm["heldout_losses"])
        assert all(len(run) == 4 and all(2.0 < x < 8.0 for x in run) for run in arm["train_losses"])
        assert arm["heldout_loss"] == pytest.approx(sum(arm["heldout_losses"]) / len(arm["seeds"]), rel=1e-12)
        assert 0 <= arm["clip_fraction"] <= 1 and all(len(t) == 4 for t in arm["step_times_s"])
        # 4 steps, all inside the 5 warm-up steps: nothing timed, no time ratio.
        assert arm["step_time"]["samples"] == 0 and arm["step_time_s"] is None
        breakdown = arm["peak_memory"]
        assert sum(breakdown.values()) == arm["peak_memory_bytes"]
        assert arm["peak_phase"] in ("forward", "backward", "optimizer step")
    assert report["speedup"] is None and "fewer than 10" in report["speedup_note"]
    # The seeds differ (initialization and batches); the control and sonar agree on the first.
    sonar, control, standard = (report["arms"][n] for n in ("sonar", "standard-dense-clip", "standard"))
    assert sonar["train_losses"][0] != sonar["train_losses"][1]
    assert sonar["train_losses"][0] == control["train_losses"][0]
    assert sonar["heldout_losses"][0] == control["heldout_losses"][0]
    # No expert gradient in sonar: its peak is below the control's. With torch's fused AdamW in every arm
    # (no step temporaries) both peaks fall in the backward, at this size before the control's expert
    # gradients reach .grad, so the gradients at the peaks are alike.
    assert sonar["peak_memory_bytes"] < control["peak_memory_bytes"]
    assert sonar["peak_memory"]["gradients"] <= control["peak_memory"]["gradients"]
    # The held-out statistics, recomputed here with torch from the per-seed losses.
    deltas = torch.tensor(sonar["heldout_losses"], dtype=torch.float64) - torch.tensor(
        standard["heldout_losses"], dtype=torch.float64
    )
    heldout = report["heldout"]
    assert heldout["deltas"] == pytest.approx(deltas.tolist(), abs=1e-15)
    assert heldout["mean_delta"] == pytest.approx(float(deltas.mean()), abs=1e-15)
    assert heldout["standard_error"] == pytest.approx(float(deltas.std() / 2**0.5), rel=1e-12)
    assert heldout["standard_seed_sd"] == pytest.approx(
        float(torch.tensor(standard["heldout_losses"], dtype=torch.float64).std())
    )
    assert report["heldout_loss_delta"] == heldout["mean_delta"]
    assert "bitwise identical (all parameters after training, seed 0): True" in out
    assert f"verdict: {heldout['verdict']}" in out and "no time ratio" in out
    assert "sonar expert updates: 16 in the backward, 0 in step(), of 16 expected" in out
    # What ran, and from which source: the resolved backend, the commit, the data.
    assert report["backend"] == report["backend_requested"] == "torch"
    assert "sonar arm: backend torch" in out
    assert report["commit"] == "unknown" or len(report["commit"]) == 40
    assert report["data"] == "pydoc_data.topics"
    # A run reserves its folder when it starts: a second run with the same name, or one started at the
    # same time, gets a new one, never the first's.
    assert train.cli.reserve_run_directory(tmp_path, "t") == tmp_path / "t-2"
    assert train.cli.reserve_run_directory(tmp_path, "t") == tmp_path / "t-3"
    assert (tmp_path / "t-3").is_dir() and not any((tmp_path / "t-3").iterdir())


def test_expert_updates_are_counted_from_the_optimizer_state_not_assumed():
    args = train.parse_args(["--backend", "torch", "--quiet", "--no-checkpointing"])
    initial = train.build_model(train.PRESETS["tiny-olmoe"], 1, 0, torch.float32, torch.device("cpu"))
    from sonar_kernels.integrations import transformers as hf

    hf.register()
    hf.set_backend(initial, "torch")
    arm = train.build_arm("sonar", initial, args, steps=3, count_updates=True)
    data = train.ByteData(train.default_text(), 16, 2, seed=0)
    train.train_step(arm, data.batch(0), 1.0)
    assert (int(arm.updates["backward"]), int(arm.updates["step"])) == (2, 0)
    arm.model.model.layers[0].mlp.experts.down_proj.requires_grad_(
        False
    )  # frozen: torch computes no gradient
    train.train_step(arm, data.batch(1), 1.0)
    assert (int(arm.updates["backward"]), int(arm.updates["step"])) == (3, 0)


def test_the_paper_arm_runs_its_backward_with_the_whole_gradient_as_the_split_paths_scratch():
    # The paper's method writes each expert tensor's whole gradient: the paper arm's backward runs under
    # split_scratch(fraction=1) (Arm.split_fraction), which the Triton split path reads; the other arms,
    # and everything after the backward, at the library's bound (a chunk of experts).
    from sonar_kernels.integrations import transformers as hf
    from sonar_kernels.ops.triton_backend import wgrad_update

    hf.register()
    args = train.parse_args(["--backend", "torch", "--quiet", "--no-checkpointing"])
    initial = train.build_model(train.PRESETS["tiny-olmoe"], 1, 0, torch.float32, torch.device("cpu"))
    hf.set_backend(initial, "torch")
    data = train.ByteData(train.default_text(), 16, 2, seed=0)
    default = wgrad_update.SPLIT_SCRATCH_FRACTION
    seen = []

    def record(module, grad_output):  # the lm_head's backward: the first of the step's backward
        seen.append(wgrad_update.SPLIT_SCRATCH_FRACTION)

    for name, during in (("paper", 1), ("sonar", default)):
        arm = train.build_arm(name, initial, args, steps=1)
        arm.model.lm_head.register_full_backward_pre_hook(record)
        seen.clear()
        train.train_step(arm, data.batch(0), 1.0)
        assert seen == [during] and default == wgrad_update.SPLIT_SCRATCH_FRACTION, (name, seen)


def test_heldout_verdict_over_seeds():
    from sonar_kernels.train.report import heldout_statistics

    standard = [2.00, 2.10, 1.95, 2.05]
    # Differences +0.010, -0.008, +0.012, -0.006: |mean| 0.002, above the negligible 0.001 and far inside
    # 2 standard errors; the verdict gives the effect first.
    same = heldout_statistics(standard, [2.010, 2.092, 1.962, 2.044])
    d = torch.tensor(same["deltas"], dtype=torch.float64)
    assert same["standard_error"] == pytest.approx(float(d.std() / 2), rel=1e-12)
    assert same["standard_seed_sd"] == pytest.approx(float(torch.tensor(standard, dtype=torch.float64).std()))
    assert same["verdict"].startswith(
        "sonar - standard +0.0020 nats per byte: no difference detectable at this scale"
    )
    assert same["negligible"] is False
    # Every seed 0.02 +- 0.001 lower: sonar better, by the mean.
    better = heldout_statistics(standard, [1.979, 2.081, 1.930, 2.030])
    assert better["verdict"].startswith("sonar lower by 0.0200")
    worse = heldout_statistics(standard, [2.021, 2.119, 1.970, 2.070])
    assert worse["verdict"].startswith("standard lower by 0.0200")
    one = heldout_statistics([2.0], [2.5])
    assert one["standard_error"] is None
    assert one["verdict"].startswith(
        "sonar - standard +0.5000 nats per byte on one seed: no statistical verdict"
    )


def test_step_times_leave_out_the_warm_up_and_give_no_ratio_on_too_few_samples():
    from sonar_kernels.train.report import TIMING_WARMUP, speedup, step_time_summary

    cold = [9.0] * TIMING_WARMUP
    fast = step_time_summary([cold + [0.1] * 6, cold + [0.1] * 6])
    slow = step_time_summary([cold + [0.2] * 12])
    assert (
        fast["samples"] == 12
        and fast["median_s"] == pytest.approx(0.1)
        and fast["p90_s"] == pytest.approx(0.1)
    )
    ratio, note = speedup(slow, fast)
    assert ratio == pytest.approx(2.0) and "12+ timed steps" in note
    few = step_time_summary([cold + [0.2] * 9])
    assert speedup(few, fast)[0] is None and "9 timed steps" in speedup(few, fast)[1]
    assert step_time_summary([[1.0, 2.0]])["median_s"] is None


def test_figure_leaves_out_panels_without_data(tmp_path):
    from sonar_kernels.train.memory import LABELS
    from sonar_kernels.train.report import heldout_statistics, plot, summary_table

    arm = {"seeds": [0], "heldout_losses": [2.0], "heldout_loss": 2.0, "train_losses": [[3.0]],
           "clip_fraction": 0.0, "peak_memory_bytes": 0, "peak_memory": dict.fromkeys(LABELS, 0),
           "peak_phase": "not measured", "step_time": step_time(), "step_time_s": None}  # fmt: skip
    report = {"preset": "tiny-olmoe", "layers": 1, "parameters": 1e6, "dtype": "float32", "device": "cpu",
              "steps": 1, "backend": "torch", "data": "pydoc_data.topics", "commit": "unknown", "seeds_run": 1,
              "arms": {"standard": arm, "sonar": {**arm, "heldout_losses": [2.1], "heldout_loss": 2.1}},
              "heldout": heldout_statistics([2.0], [2.1]), "speedup": None, "speedup_note": "no time ratio"}  # fmt: skip
    assert plot(report, tmp_path / "a.png") == ["heldout"]
    table = summary_table(report)
    assert (
        "nan" not in table and "peak memory: not measured" in table and "on one seed: no statistical" in table
    )
    report["steps"] = 2
    for r in report["arms"].values():
        r["train_losses"] = [[3.0, 2.5]]
        r["peak_memory_bytes"] = r["peak_memory"]["parameters"] = 2**20
    assert plot(report, tmp_path / "b.png") == ["loss", "heldout", "memory"]


def step_time():
    from sonar_kernels.train.report import step_time_summary

    return step_time_summary([[0.1]])


def test_a_missing_train_extra_exits_2_naming_the_install_command(tmp_path, capsys, monkeypatch):
    import importlib.util

    from sonar_kernels.train import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)
    )
    assert cli.main(["--steps", "1", "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "matplotlib not installed" in err and "pip install -e '.[train]'" in err
    assert "pip install matplotlib" in err and "sonar-kernels[train]" not in err  # not on PyPI
    assert not any(tmp_path.iterdir())  # nothing trained, nothing written


def test_help_describes_the_run_and_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        train.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "module docstring" not in out
        and "standard-dense-clip (its control, which must equal sonar bit for bit)" in out
    )
    options = out[out.index("options:") :]
    for option, default in (
        ("--lr", "0.003"),
        ("--max-grad-norm", "1.0"),
        ("--seed", "0"),
        ("--preset", "tiny-olmoe"),
        ("--seeds", "3"),
        ("--heldout-batches", "32"),
    ):
        # the option's own help text, up to the next option
        text = options[options.index(f" {option} ") :]
        assert f"default: {default}" in text[: text.index(" --", 1)], option
    assert "default: None" not in out and "all-in-backward, an extra arm" in out


def test_bad_device_backend_and_out_exit_2_before_any_training(tmp_path, capsys):
    taken = tmp_path / "file"
    taken.write_text("x")
    for argv, words in (
        (["--seeds", "0"], "--seeds must be >= 1"),
        (["--warmup-steps", "-5"], "--warmup-steps must be >= 0"),
        (["--heldout-batches", "-1"], "--heldout-batches must be >= 0"),
        (["--arms", "standard", "sonar", "sonar"], "--arms: sonar given more than once"),
        (["--steps", "3", "--warmup-steps", "5"], "--warmup-steps 5 is more than the 3 training steps"),
        (["--name", "../elsewhere"], "must be a folder name, without a path"),
        (["--device", "tpu"], "--device 'tpu'"),
        (["--out", str(taken)], "exists and is not a folder"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            train.main(argv)
        assert exit_info.value.code == 2
        assert words in capsys.readouterr().err
    # Found when the run reserves its folder, before any training: a file in the way of --out/NAME.
    assert train.main(["--out", str(taken / "sub"), "--quiet"]) == 2
    assert "cannot create" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            train.main(["--device", "cuda"])
        assert "no CUDA device here" in capsys.readouterr().err


def test_real_presets_have_the_models_dimensions():
    # docs/design.md: OLMoE-1B-7B (H 2048, I 1024, E 64, top-8, 16 layers), Granite-3.1-3B-A800M (H 1536,
    # I 512, E 40, top-8, 32 layers); heads and vocabularies from the models' configs.
    olmoe, granite = train.PRESETS["olmoe-1b-7b"], train.PRESETS["granite-3.1-3b-a800m"]
    assert (olmoe.hidden_size, olmoe.intermediate_size, olmoe.num_experts, olmoe.top_k, olmoe.num_layers) == (
        2048, 1024, 64, 8, 16,
    )  # fmt: skip
    assert (olmoe.num_heads, olmoe.vocab_size) == (16, 50304)
    assert (granite.hidden_size, granite.intermediate_size, granite.num_experts, granite.top_k) == (
        1536,
        512,
        40,
        8,
    )
    assert (granite.num_layers, granite.num_heads, granite.num_kv_heads, granite.vocab_size) == (
        32,
        24,
        8,
        49155,
    )
    with torch.device("meta"):  # the full-size model, without allocating it
        from sonar_kernels.integrations import transformers as hf

        hf.register()
        model = train.build_model(olmoe, 2, 0, torch.bfloat16, torch.device("meta"))
    experts = model.model.layers[0].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (64, 2048, 2048) and model.config.num_hidden_layers == 2


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_all_in_backward_arm_updates_every_parameter_in_the_backward_like_unclipped_adamw(backend):
    from numerics import assert_close

    from sonar_kernels.integrations import transformers as hf

    hf.register()
    # On the Triton backend (the interpreter here) a smaller model: H 32, 4 experts of I 16, top-2.
    preset = (
        train.PRESETS["tiny-olmoe"]
        if backend == "torch"
        else train.Preset("olmoe", 32, 16, 4, 2, 1, 2, 2, 256)
    )
    initial = hf.set_backend(train.build_model(preset, 1, 0, torch.float32, torch.device("cpu")), backend)
    # max_grad_norm 1e30: clip_grad_norm_ multiplies by exactly 1.0, so "standard" is unclipped AdamW.
    args = train.parse_args(["--max-grad-norm", "1e30", "--no-checkpointing", "--arms", "all-in-backward"])
    data = train.ByteData(train.default_text(), 16 if backend == "triton" else 32, 2, seed=0)
    arms = {name: train.build_arm(name, initial, args, steps=3) for name in ("standard", "all-in-backward")}
    for step in range(3):
        for name, arm in arms.items():
            loss = arm.model(input_ids=data.batch(step), labels=data.batch(step)).loss
            loss.backward()
            if name == "all-in-backward":  # every gradient was applied and released in the backward
                assert all(p.grad is None for p in arm.model.parameters())
            else:
                torch.nn.utils.clip_grad_norm_(arm.clip_params, args.max_grad_norm)
            arm.optimizer.step()
            for scheduler in arm.schedulers:
                scheduler.step()
            arm.optimizer.zero_grad(set_to_none=True)
    standard, in_backward = (list(arms[n].model.named_parameters()) for n in ("standard", "all-in-backward"))
    assert all(not torch.equal(p, q) for (_, p), q in zip(standard, initial.parameters(), strict=True))
    for (name, p), (_, q) in zip(standard, in_backward, strict=True):
        if backend == "torch":  # the same torch AdamW arithmetic on the same gradients
            assert torch.equal(p, q), name
        else:  # the Triton wgrad and its fused epilogue: fp32 sums in another order
            assert_close(q, p, torch.float32, what=name)


def test_paper_inbwd_arms_update_the_experts_in_the_backward_with_the_controls_bits():
    """paper-inbwd and per-expert-inbwd (torch's AdamW per batched expert tensor, or per expert slice, from
    the tensor's gradient hook; dense clipping) against standard-dense-clip, which applies the same torch
    AdamW to the same materialized gradients after the backward: equal weights and moments, bit for bit,
    with the dense gradients clipped (max_grad_norm 0.05) and the experts not."""
    from sonar_kernels.integrations import transformers as hf

    hf.register()
    preset = train.PRESETS["tiny-olmoe"]
    initial = hf.set_backend(train.build_model(preset, 1, 0, torch.float32, torch.device("cpu")), "torch")
    args = train.parse_args(
        ["--max-grad-norm", "0.05", "--no-checkpointing", "--arms", "paper-inbwd", "per-expert-inbwd"]
    )
    data = train.ByteData(train.default_text(), 32, 2, seed=0)
    names = ("standard-dense-clip", "paper-inbwd", "per-expert-inbwd")
    arms = {name: train.build_arm(name, initial, args, steps=3) for name in names}
    experts = {
        name: [p for n, p in arm.model.named_parameters() if n.endswith(train.EXPERT_PARAMS)]
        for name, arm in arms.items()
    }
    norms = {}
    for step in range(3):
        for name, arm in arms.items():
            _, norms[name] = train.train_step(arm, data.batch(step), args.max_grad_norm)
    assert all(norms[n] > args.max_grad_norm for n in names)  # the dense gradients were clipped
    control = arms["standard-dense-clip"]
    for name in names[1:]:
        arm = arms[name]
        assert all(p.grad is None for p in experts[name])  # applied and released in the backward
        for (n, p), q in zip(arm.model.named_parameters(), control.model.parameters(), strict=True):
            assert torch.equal(p, q), (name, n)
        for p, q in zip(experts[name], experts["standard-dense-clip"], strict=True):
            state, reference = arm.optimizer.experts[p].state[p], control.optimizer.state[q]
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[key], reference[key]), (name, key)
            steps = state["steps"] if name == "per-expert-inbwd" else [state["step"]]
            assert all(torch.equal(s, reference["step"]) for s in steps)
    assert not torch.equal(
        control.model.model.layers[0].mlp.experts.down_proj, initial.model.layers[0].mlp.experts.down_proj
    )


def _torchrun_train(argv, tmp_path):
    import os
    import subprocess
    import sys

    import ranks

    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
         str(ranks.free_port()), "-m", "sonar_kernels.train", *argv, "--out", str(tmp_path), "--name", "d"],
        capture_output=True, text=True, timeout=240, env=os.environ | {"OMP_NUM_THREADS": "1"},
    )  # fmt: skip


@pytest.mark.timeout(300)
def test_data_parallel_run_on_two_processes_reports_ranks_that_agree(tmp_path):
    done = _torchrun_train(
        [
            "--steps",
            "4",
            "--seeds",
            "1",
            "--layers",
            "1",
            "--batch-size",
            "2",
            "--seq-len",
            "32",
            "--heldout-batches",
            "2",
        ],
        tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "d" / "report.json").read_text())
    dist = report["distributed"]
    assert dist["ranks"] == 2 and "data parallel" in dist["layout"]
    sums = dist["expert_checksums"]
    assert set(sums) == {"standard", "sonar", "standard-dense-clip"}
    assert all(len(s) == 2 and s[0] == s[1] for s in sums.values()) and dist["ranks_agree"] is True
    # Averaged before the update, the experts train as DDP's do: the control's bits.
    assert sums["sonar"] == sums["standard-dense-clip"] != sums["standard"]
    assert report["sonar_equals_control_bitwise"] is True
    assert "the ranks' dense and expert weights are identical in every arm: True" in done.stdout
    refused = _torchrun_train(
        ["--steps", "1", "--layers", "1", "--arms", "all-in-backward", "paper-inbwd"], tmp_path
    )
    assert refused.returncode != 0 and "runs on one process only" in refused.stderr


@pytest.mark.timeout(300)
def test_expert_parallel_run_on_two_processes(tmp_path):
    done = _torchrun_train(
        ["--ep", "2", "--steps", "4", "--seeds", "1", "--layers", "1", "--batch-size", "2", "--seq-len", "32",
         "--heldout-batches", "2", "--no-memory"],
        tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "d" / "report.json").read_text())
    dist = report["distributed"]
    assert dist["ranks"] == 2 and dist["expert_parallel"] is True and "16 of the 32 experts" in dist["layout"]
    assert dist["ranks_agree"] is True
    for arm in ("standard", "sonar", "standard-dense-clip"):
        dense, experts = dist["dense_checksums"][arm], dist["expert_checksums"][arm]
        assert dense[0] == dense[1] and experts[0] != experts[1]  # each rank its own experts
    # The experts updated in the backward from their complete local gradient: the control's bits.
    assert dist["expert_checksums"]["sonar"] == dist["expert_checksums"]["standard-dense-clip"]
    assert report["sonar_equals_control_bitwise"] is True
    wrong = _torchrun_train(["--ep", "4", "--steps", "1", "--layers", "1"], tmp_path)
    assert wrong.returncode != 0 and "--ep 4 needs 4 ranks" in wrong.stderr


def test_moments_8bit_adds_the_sonar_8bit_arm_with_its_heldout_statistics_and_smaller_state(tmp_path):
    argv = ["--steps", "3", "--seeds", "2", "--layers", "1", "--batch-size", "2", "--seq-len", "32",
            "--heldout-batches", "2", "--out", str(tmp_path), "--name", "m", "--quiet", "--backend", "torch",
            "--timing-rounds", "0", "--arms", "standard", "sonar", "--moments", "8bit"]  # fmt: skip
    # torchao (the [test] extra) is installed: its AdamW8bit runs as the anchor arm.
    assert train.parse_args(argv).arms == ["standard", "sonar", "sonar-8bit", "torchao-8bit"]
    assert train.main(argv) == 0
    report = json.loads((tmp_path / "m" / "report.json").read_text())
    arms = report["arms"]
    assert set(arms) == {"standard", "sonar", "sonar-8bit", "torchao-8bit"}
    for arm, suffix in (("sonar-8bit", "8bit"), ("torchao-8bit", "torchao_8bit")):
        assert arms[arm]["seeds"] == [0, 1]
        deltas = torch.tensor(arms[arm]["heldout_losses"], dtype=torch.float64) - torch.tensor(
            arms["standard"]["heldout_losses"], dtype=torch.float64
        )
        assert report[f"heldout_{suffix}"]["deltas"] == pytest.approx(deltas.tolist(), abs=1e-15)
        # The optimizer state: 8-bit codes and scales (2.25 bytes per expert parameter; torchao's 2.03)
        # against fp32 moments.
        assert (
            arms[arm]["peak_memory"]["optimizer_state"]
            < 0.5 * arms["sonar"]["peak_memory"]["optimizer_state"]
        )
        ratio = arms[arm]["peak_memory_bytes"] / arms["standard"]["peak_memory_bytes"]
        assert report[f"peak_memory_ratio_{suffix}"] == pytest.approx(ratio, rel=1e-12)


def test_master_weights_add_their_arms_the_mixed_precision_reference_and_the_remainder_control(tmp_path):
    argv = ["--steps", "3", "--seeds", "2", "--layers", "1", "--batch-size", "2", "--seq-len", "32",
            "--heldout-batches", "2", "--out", str(tmp_path), "--name", "mw", "--quiet", "--backend", "torch",
            "--timing-rounds", "0", "--arms", "standard", "--dtype", "bfloat16",
            "--master-weights", "remainder", "stochastic"]  # fmt: skip
    assert train.parse_args(argv).arms == [
        "standard", "mixed-precision", "sonar-remainder", "remainder-control", "sonar-stochastic"
    ]  # fmt: skip
    with pytest.raises(SystemExit):  # fp32 weights: nothing to keep a master for
        train.parse_args([a for a in argv if a not in ("--dtype", "bfloat16")])
    assert train.main(argv) == 0
    report = json.loads((tmp_path / "mw" / "report.json").read_text())
    arms = report["arms"]
    # The control: torch.optim.AdamW on fp32 copies of the experts, dense gradients clipped as SonarAdamW
    # clips them; sonar-remainder's weight and remainder must be those masters bit for bit.
    assert report["remainder_equals_control_bitwise"] is True and arms["remainder-control"]["seeds"] == [0]
    versus = report["versus_mixed_precision"]
    assert set(versus) == {"standard", "sonar-remainder", "sonar-stochastic"}
    for name, entry in versus.items():
        deltas = torch.tensor(arms[name]["heldout_losses"], dtype=torch.float64) - torch.tensor(
            arms["mixed-precision"]["heldout_losses"], dtype=torch.float64
        )
        assert entry["heldout"]["deltas"] == pytest.approx(deltas.tolist(), abs=1e-15)
        ratio = arms[name]["peak_memory_bytes"] / arms["mixed-precision"]["peak_memory_bytes"]
        assert entry["peak_memory_ratio"] == pytest.approx(ratio, rel=1e-12)
    # What each keeps: mixed precision an fp32 master of every parameter (2 + 4 bytes of parameters per
    # bf16 one); the remainder 2 bytes per expert parameter in place of stochastic rounding's seeds.
    params = arms["standard"]["peak_memory"]["parameters"]
    assert arms["mixed-precision"]["peak_memory"]["parameters"] == 3 * params
    experts = report["expert_parameters"]
    state = {
        name: arms[name]["peak_memory"]["optimizer_state"] for name in ("sonar-remainder", "sonar-stochastic")
    }
    seeds = 8 * 2 * report["layers"]  # stochastic rounding's 0-dim int64 seed per expert tensor
    assert state["sonar-remainder"] - state["sonar-stochastic"] == 2 * experts - seeds
