"""sonar-train's expert-clipping arms (--expert-clipping spike lagged), their controls, the injected loss
spike (--inject-spike STEP:SCALE) and the report's verdicts for them."""

import json

import pytest
import torch

from sonar_kernels import train

pytest.importorskip("transformers", minversion="5.13")

# The smallest run the sonar-train tests use: 1 layer of tiny-olmoe, 4 steps of 2 x 32 bytes, 2 seeds.
TINY = ["--steps", "4", "--seeds", "2", "--layers", "1", "--batch-size", "2", "--seq-len", "32",
        "--heldout-batches", "2", "--quiet", "--backend", "torch", "--timing-rounds", "0"]  # fmt: skip
CLIPPING = ["--expert-clipping", "spike", "lagged"]
SPIKE_STEP, SPIKE_SCALE = 3, 1000.0


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    """Each test runs in its own folder: a run without --out writes runs/ there, never in the checkout."""
    monkeypatch.chdir(tmp_path)


def test_the_options_add_the_arms_and_their_controls_and_pass_the_threshold_through():
    args = train.parse_args([*CLIPPING, "--inject-spike", "60:1000"])
    assert args.arms == ["standard", "sonar", "standard-dense-clip", "sonar-spike", "spike-control",
                         "sonar-lagged", "lagged-control"]  # fmt: skip
    assert args.inject_spike == (60, 1000.0) and args.spike_threshold == 5000.0  # SPAM's default
    assert train.parse_args([]).inject_spike is None
    args = train.parse_args(["--expert-clipping", "spike", "--spike-threshold", "250", "--backend", "torch"])
    assert args.arms[-2:] == ["sonar-spike", "spike-control"] and args.spike_threshold == 250.0
    from sonar_kernels.integrations import transformers as hf

    hf.register()
    initial = hf.set_backend(
        train.build_model(train.PRESETS["tiny-olmoe"], 1, 0, torch.float32, torch.device("cpu")), "torch"
    )
    spike = train.build_arm("sonar-spike", initial, args, steps=2).optimizer
    assert (spike.expert_clipping, spike.spike_threshold) == ("spike", 250.0)
    assert train.build_arm("spike-control", initial, args, steps=2).optimizer.threshold == 250.0
    # lagged clips to the norm every arm clips to (--max-grad-norm).
    args = train.parse_args(["--expert-clipping", "lagged", "--max-grad-norm", "0.5"])
    lagged = train.build_arm("sonar-lagged", initial, args, steps=2).optimizer
    assert (lagged.expert_clipping, lagged.max_grad_norm) == ("lagged", 0.5)
    assert train.build_arm("sonar", initial, args, steps=2).optimizer.expert_clipping == "none"


def test_bad_clipping_options_exit_2_with_a_message_before_any_training(capsys):
    for argv, words in (
        (["--inject-spike", "60"], "expected STEP:SCALE (e.g. 60:1000), got '60'"),
        (["--inject-spike", "a:10"], "STEP must be an integer, got 'a'"),
        (["--inject-spike", "2.5:10"], "STEP must be an integer, got '2.5'"),
        (["--inject-spike", "5:x"], "SCALE must be a number, got 'x'"),
        (["--inject-spike", "5:0"], "SCALE must be a finite number > 0, got 0"),
        (["--inject-spike", "5:-2"], "SCALE must be a finite number > 0, got -2"),
        (["--inject-spike", "5:inf"], "SCALE must be a finite number > 0, got inf"),
        (["--inject-spike", "5:nan"], "SCALE must be a finite number > 0, got nan"),
        (["--inject-spike", "0:10"], "step 0 is not one of the run's training steps (1 to 200)"),
        (["--steps", "4", "--inject-spike", "5:10"], "step 5 is not one of the run's training steps (1 to 4)"),
        (["--spike-threshold", "10"], "--spike-threshold applies to the sonar-spike arm: add --expert-clipping spike"),
        (["--expert-clipping", "spike", "--spike-threshold", "0"], "--spike-threshold must be a finite number > 0"),
        (["--expert-clipping", "spike", "--spike-threshold", "inf"], "--spike-threshold must be a finite number > 0"),
        (["--expert-clipping", "global"], "invalid choice: 'global'"),
        (["--arms", "sonar-spike", "sonar-spike"], "--arms: sonar-spike given more than once"),
        (["--spike-baseline", "report.json"], "--spike-baseline compares a run with --inject-spike to one without"),
        (["--inject-spike", "2:10", "--spike-baseline", "nope.json"], "--spike-baseline nope.json: no such file"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            train.main(argv)
        assert exit_info.value.code == 2, argv
        err = capsys.readouterr().err
        assert words in err, (argv, err)
        if "--inject-spike" in argv:
            assert "--inject-spike" in err  # the message names the option


def test_several_processes_are_refused_by_name(tmp_path, capsys, monkeypatch):
    from sonar_kernels.train import cli

    monkeypatch.setattr(cli.distributed, "setup", lambda args: None)
    monkeypatch.setattr(cli.distributed, "world_size", lambda: 2)
    assert train.main([*TINY, "--expert-clipping", "lagged", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--expert-clipping (sonar-lagged, lagged-control) runs on one process only" in err
    assert not any(tmp_path.iterdir())  # refused before the run reserved its folder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_controls_rules_are_the_references_bit_for_bit(dtype):
    """The controls write SPAM's rule and the lagged coefficient plainly (the package does not import the
    reference): the same bits as sonar_kernels.reference's, spikes, ties, v = 0 and signs included."""
    from sonar_kernels import reference
    from sonar_kernels.train import clipping

    g = torch.randn(64, 96).to(dtype)
    v = torch.rand(64, 96) * 1e-3
    v[::7] = 0.0  # an element's first update: never clipped
    g[::3] *= 1e4  # spikes, of both signs
    tie = torch.sqrt(v[1, 0] * torch.tensor(50.0)).to(dtype)  # g^2 right at the limit
    g[1, 0] = tie
    for threshold in (50.0, 5000.0, 0.1):
        ours, count = clipping.spike_clip(g, v, threshold)
        theirs, expected = reference.spike_clip(g, v, threshold)
        assert ours.dtype == dtype and torch.equal(ours, theirs) and int(count) == expected > 0
    for norm in (0.0, 0.3, 0.999999, 1.0, 7.5, 1e6, float("inf")):
        for max_norm in (1.0, 0.5):
            t = torch.tensor(norm)
            assert torch.equal(
                clipping.lagged_clip_coef(t, max_norm), reference.lagged_clip_coef(t, max_norm)
            )


def test_the_control_measures_the_global_norm_as_the_lagged_arm_does():
    """The lagged control's clipping coefficients are the arm's bits only if its norm is: each expert
    tensor's squared norm with the torch backend's arithmetic (chunks of experts, a dot per chunk)."""
    from sonar_kernels.integrations import transformers as hf

    hf.register()
    initial = hf.set_backend(
        train.build_model(train.PRESETS["tiny-olmoe"], 1, 0, torch.float32, torch.device("cpu")), "torch"
    )
    args = train.parse_args(["--expert-clipping", "lagged", "--backend", "torch", "--no-checkpointing"])
    args.fused = True  # as cli.main sets it on the CPU
    arms = {
        name: train.build_arm(name, initial, args, steps=2) for name in ("sonar-lagged", "lagged-control")
    }
    tokens = train.ByteData(train.default_text(), 128, 4, seed=0).batch(0)
    for arm in arms.values():
        arm.model(input_ids=tokens, labels=tokens).loss.backward()
    sonar, control = (list(arms[n].model.named_parameters()) for n in arms)
    optimizer = arms["sonar-lagged"].optimizer
    experts = [
        (p, q.grad) for (n, p), (_, q) in zip(sonar, control, strict=True) if n.endswith(train.EXPERT_PARAMS)
    ]
    assert len(experts) == 2 and all(g.numel() * 4 > 2**20 for _, g in experts)  # several chunks each
    for p, grad in experts:
        assert torch.equal(
            train.clipping.expert_norm_sq(grad, fused=True).sqrt(), optimizer.expert_grad_norm([p])
        )
    dense = [q.grad for (n, q) in control if not n.endswith(train.EXPERT_PARAMS)]
    optimizer.step()
    norm = train.clipping.lagged_global_norm(dense, [g for _, g in experts], fused=True)
    assert torch.equal(norm, optimizer.last_grad_norm)


def _run(tmp_path, name, extra):
    argv = [*TINY, "--out", str(tmp_path), "--name", name, *CLIPPING, *extra]
    assert train.main(argv) == 0
    return json.loads((tmp_path / name / "report.json").read_text())


def test_tiny_run_with_an_injected_spike_reports_the_clipping_arms_and_their_verdicts(tmp_path, capfd):
    from sonar_kernels.reference import lagged_clip_coef
    from sonar_kernels.train.report import heldout_statistics

    calm = _run(tmp_path, "calm", ["--no-memory"])  # the same run without the spike: the baseline
    capfd.readouterr()
    baseline = str(tmp_path / "calm" / "report.json")
    inject = ["--inject-spike", f"{SPIKE_STEP}:{SPIKE_SCALE:g}"]
    report = _run(tmp_path, "spike", [*inject, "--spike-baseline", baseline])
    out, err = capfd.readouterr()
    assert err == "", err
    arms = report["arms"]
    assert list(arms) == ["standard", "sonar", "standard-dense-clip", "sonar-spike", "spike-control",
                          "sonar-lagged", "lagged-control"]  # fmt: skip
    assert report["inject_spike"] == {"step": SPIKE_STEP, "scale": SPIKE_SCALE}
    assert report["spike_threshold"] == 5000.0
    for name in ("spike-control", "lagged-control"):
        assert arms[name]["seeds"] == [0]
    # Each clipping arm against standard (global clipping) and sonar (no expert clipping), over the seeds,
    # with the report's verdict machinery; recomputed here from the per-seed losses.
    clipping = report["expert_clipping"]
    assert set(clipping) == {"sonar-spike", "sonar-lagged"}
    assert "expert clipping (spike injected: step 3's loss x1000 in every arm" in out
    for name, entry in clipping.items():
        for reference in ("standard", "sonar"):
            expected = heldout_statistics(
                arms[reference]["heldout_losses"],
                arms[name]["heldout_losses"],
                name=name,
                reference=reference,
            )
            assert entry[f"versus_{reference}"] == expected
            assert f"  {name} - {reference}: " in out and f"verdict: {expected['verdict']}" in out
        # Bitwise its control (first seed), every expert update in the backward.
        assert entry["equals_control_bitwise"] is True
        assert entry["expert_updates"] == {"backward": 2 * 4 * 2, "step": 0, "expected": 2 * 4 * 2}
        assert f"{name} and {entry['control']} bitwise identical" in out and out.count("): True") >= 3
        assert entry["peak_memory_ratio_to_sonar"] == pytest.approx(
            arms[name]["peak_memory_bytes"] / arms["sonar"]["peak_memory_bytes"], rel=1e-12
        )
        assert entry["step_time_ratio_to_sonar"] is None  # 4 steps: none timed
    assert report["heldout"]["verdict"] in out  # sonar - standard, as before
    # The spike rule's telemetry: nothing before the second moment exists (step 1), the spike step's
    # elements replaced; the control counts the same elements by hand.
    spike = arms["sonar-spike"]["clipping"]
    assert [run[0] for run in spike] == [0, 0] and all(run[SPIKE_STEP - 1] > 0 for run in spike)
    assert arms["spike-control"]["clipping"] == spike[:1]
    assert clipping["sonar-spike"]["clipped_elements"] == [sum(run) for run in spike]
    assert clipping["sonar-spike"]["clipped_elements_at_spike"] == [run[SPIKE_STEP - 1] for run in spike]
    # The lagged coefficient of each step is torch's clipping coefficient of that step's global norm (the
    # arm's recorded grad norm), and the spike's is about 1000 times smaller than the others.
    lagged = arms["sonar-lagged"]
    for coefs, norms in zip(lagged["clipping"], lagged["grad_norms"], strict=True):
        assert coefs == [float(lagged_clip_coef(torch.tensor(n), 1.0)) for n in norms]
        assert coefs[SPIKE_STEP - 1] < min(coefs[: SPIKE_STEP - 1]) / 100
    assert arms["lagged-control"]["clipping"] == lagged["clipping"][:1]
    assert (tmp_path / "spike" / "report.png").stat().st_size > 10_000

    # Against the same run without the spike: every arm's loss at the spike's step was multiplied by SCALE,
    # the steps before it are the same, and the spike changed the training after it.
    assert calm["inject_spike"] is None and "expert_clipping" in calm
    for name, arm in arms.items():
        for spiked, plain in zip(arm["train_losses"], calm["arms"][name]["train_losses"], strict=True):
            assert spiked[: SPIKE_STEP - 1] == plain[: SPIKE_STEP - 1], name
            multiplied = torch.tensor(plain[SPIKE_STEP - 1], dtype=torch.float32) * SPIKE_SCALE
            assert spiked[SPIKE_STEP - 1] == float(multiplied), name
        if arm["grad_norms"] is not None:  # the gradient was multiplied, not only the reported loss
            spiked, plain = (
                arm["grad_norms"][0][SPIKE_STEP - 1],
                calm["arms"][name]["grad_norms"][0][SPIKE_STEP - 1],
            )
            assert spiked == pytest.approx(SPIKE_SCALE * plain, rel=1e-3), name
    # Unclipped experts take the spike whole: sonar's next loss differs from the calm run's.
    assert (
        arms["sonar"]["train_losses"][0][SPIKE_STEP] != calm["arms"]["sonar"]["train_losses"][0][SPIKE_STEP]
    )
    assert "expert clipping (no spike injected;" in train.summary_table(calm)
    # The spike's effect per arm, paired over the seeds: this run's held-out losses minus the baseline's.
    effect = report["spike_effect"]
    assert effect["baseline"] == baseline
    assert list(effect["arms"]) == ["standard", "sonar", "sonar-spike", "sonar-lagged"]  # no control
    for name, held in effect["arms"].items():
        deltas = torch.tensor(arms[name]["heldout_losses"], dtype=torch.float64) - torch.tensor(
            calm["arms"][name]["heldout_losses"], dtype=torch.float64
        )
        assert held["deltas"] == pytest.approx(deltas.tolist(), abs=1e-15)
        assert f"verdict: {held['verdict']}" in out
    assert "spike effect (held-out loss with step 3's loss x1000 minus the same run without it" in out
    # A baseline that is not the same run, or that injected a spike itself, is refused before training.
    spiked = str(tmp_path / "spike" / "report.json")
    for extra, words in (
        (["--steps", "5", "--spike-baseline", baseline], "steps 4 there, 5 here"),
        (["--lr", "0.001", "--spike-baseline", baseline], "lr 0.003 there, 0.001 here"),
        (["--spike-baseline", spiked], "that run injected a spike too (step 3, x1000)"),
    ):
        argv = [*TINY, "--out", str(tmp_path), "--name", "refused", *CLIPPING, *inject, *extra]
        try:
            code = train.main(argv)
        except SystemExit as e:
            code = e.code
        assert code == 2 and words in capfd.readouterr().err, extra
    assert not (tmp_path / "refused").exists()
