"""sonar-train's progress lines, Ctrl-C and --resume: an interrupted run keeps what finished, writes a
partial report and exits 130; resumed, it runs only what is missing and reports what an uninterrupted run
of the same options reports, bit for bit."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from sonar_kernels import train
from sonar_kernels.train import cli

pytest.importorskip("transformers", minversion="5.13")

TINY = ["--steps", "3", "--seeds", "2", "--layers", "1", "--batch-size", "2", "--seq-len", "32",
        "--heldout-batches", "1", "--backend", "torch", "--timing-rounds", "1"]  # fmt: skip
# What must come out the same, bit for bit, per arm and at the top level.
PER_ARM = (
    "seeds",
    "train_losses",
    "heldout_losses",
    "grad_norms",
    "clip_fractions",
    "peak_memory",
    "peak_phase",
)
TOP = ("heldout", "sonar_equals_control_bitwise", "sonar_expert_updates_in_backward",
       "sonar_expert_updates_expected", "peak_memory_reduction", "expert_tensors")  # fmt: skip


def test_ctrl_c_between_sonar_and_its_control_then_resume_gives_the_uninterrupted_report(
    tmp_path, capfd, monkeypatch
):
    assert train.main([*TINY, "--out", str(tmp_path), "--name", "whole"]) == 0
    err = capfd.readouterr().err
    # Progress: one line per finished (seed, arm), its place in the run and its time; then the passes.
    for k, what in enumerate(["seed 0 standard", "seed 0 sonar", "seed 0 standard-dense-clip",
                              "seed 1 standard", "seed 1 sonar"], start=1):  # fmt: skip
        assert f"sonar-train: run {k} of 5 finished: {what}, " in err
    assert "sonar-train: memory pass finished" in err and "sonar-train: timing pass finished" in err
    whole = json.loads((tmp_path / "whole" / "report.json").read_text())

    calls = []
    real = cli.run_arm

    def interrupted_at_the_control(arm, *args, **kwargs):
        calls.append(arm.name)
        if len(calls) == 3:  # seed 0's standard-dense-clip, after sonar finished: Ctrl-C
            raise KeyboardInterrupt
        return real(arm, *args, **kwargs)

    monkeypatch.setattr(cli, "run_arm", interrupted_at_the_control)
    folder = tmp_path / "cut"
    assert train.main([*TINY, "--out", str(tmp_path), "--name", "cut", "--quiet"]) == 130
    out, err = capfd.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err  # one line, no traceback
    assert err.startswith("sonar-train: interrupted; finished 2 of 5 runs (seed 0: standard, sonar)")
    assert "sonar on seed 0 trains again with standard-dense-clip" in err
    assert err.rstrip().endswith(f"resume with: sonar-train --resume {folder}")
    partial = json.loads((folder / "report.json").read_text())
    assert partial["partial"]["finished"] == ["seed 0 standard", "seed 0 sonar"]
    assert partial["partial"]["missing"] == ["seed 0 standard-dense-clip", "seed 1 standard", "seed 1 sonar"]
    assert set(partial["arms"]) == {"standard", "sonar"} and "heldout" not in partial
    assert partial["arms"]["sonar"]["train_losses"] == whole["arms"]["sonar"]["train_losses"][:1]

    # Other options than the interrupted run's are refused, each named, before anything runs.
    monkeypatch.setattr(cli, "run_arm", real)
    with pytest.raises(SystemExit) as refused:
        train.main(["--resume", str(folder), "--steps", "4", "--lr", "0.01"])
    err = capfd.readouterr().err
    assert refused.value.code == 2
    assert "--lr 0.01 here, 0.003 there" in err and "--steps 4 here, 3 there" in err

    calls.clear()

    def counted(arm, *args, **kwargs):
        calls.append(arm.name)
        return real(arm, *args, **kwargs)

    monkeypatch.setattr(cli, "run_arm", counted)
    assert train.main(["--resume", str(folder)]) == 0
    err = capfd.readouterr().err
    # standard on seed 0 is loaded; sonar trains again beside its control (its parameters were not kept).
    assert calls == ["sonar", "standard-dense-clip", "standard", "sonar"]
    assert f"resuming {folder}: 1 of 5 runs (seed 0: standard) finished" in err
    assert "sonar-train: run 2 of 5 finished: seed 0 sonar" in err
    resumed = json.loads((folder / "report.json").read_text())
    assert "partial" not in resumed and resumed["resumed"] == "1 of 5 runs (seed 0: standard)"
    for name, arm in whole["arms"].items():
        for key in PER_ARM:
            assert resumed["arms"][name][key] == arm[key], (name, key)
    for key in TOP:
        assert resumed[key] == whole[key], key
    assert resumed["sonar_equals_control_bitwise"] is True and (folder / "report.png").exists()
    with pytest.raises(SystemExit) as finished:  # nothing left to resume
        train.main(["--resume", str(folder)])
    assert finished.value.code == 2 and "that run finished" in capfd.readouterr().err


def test_sigint_ends_a_running_sonar_train_with_one_line_and_exit_code_130(tmp_path, capfd):
    folder = tmp_path / "sig"
    argv = [*TINY, "--steps", "20", "--out", str(tmp_path), "--name", "sig", "--quiet"]
    process = subprocess.Popen(
        [sys.executable, "-m", "sonar_kernels.train", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=os.environ | {"OMP_NUM_THREADS": "1"},
        # A worker of a test runner may ignore SIGINT; the child takes Python's default (KeyboardInterrupt).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    first = folder / "resume" / "seed0-standard.json"
    deadline = time.monotonic() + 120
    while not first.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130, err[-3000:]
    assert "Traceback" not in err and out == ""
    last = err.strip().splitlines()[-1]
    assert last.startswith("sonar-train: interrupted; finished ") and f"sonar-train --resume {folder}" in last
    partial = json.loads((folder / "report.json").read_text())
    assert "seed 0 standard" in partial["partial"]["finished"]
    # The kept run is what the resumed report holds for it.
    kept = json.loads(first.read_text())
    assert train.main(["--resume", str(folder), "--quiet"]) == 0
    report = json.loads((folder / "report.json").read_text())
    assert report["arms"]["standard"]["train_losses"][0] == kept["train_losses"]
    assert report["sonar_equals_control_bitwise"] is True and len(report["arms"]["sonar"]["seeds"]) == 2


def _interrupted_folder(tmp_path, argv, commit=None):
    """A run folder as an interrupted run leaves it before any (seed, arm) finished: its options.json."""
    folder = tmp_path / "cut"
    (folder / "resume").mkdir(parents=True)
    written = {"argv": argv, "options": {}} | ({} if commit is None else {"commit": commit})
    (folder / "resume" / "options.json").write_text(json.dumps(written))
    return folder


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (["--expert-clipping", "lagged"], "--expert-clipping ['lagged'] here, ['spike'] there"),
        (["--spike-threshold", "7"], "--spike-threshold 7.0 here, 100.0 there"),
        (["--max-grad-norm", "2"], "--max-grad-norm 2.0 here, 1.0 there"),
    ],
)
def test_resume_with_a_changed_clipping_option_names_that_option(tmp_path, capfd, given, named):
    # Before the options' own checks: "--spike-threshold applies to the sonar-spike arm" answered a changed
    # --expert-clipping, naming another option than the one changed.
    argv = [*TINY, "--expert-clipping", "spike", "--spike-threshold", "100", "--out", str(tmp_path)]
    folder = _interrupted_folder(tmp_path, argv)
    with pytest.raises(SystemExit) as refused:
        train.main(["--resume", str(folder), *given])
    err = capfd.readouterr().err
    assert refused.value.code == 2 and "the options differ from the interrupted run's" in err
    assert named in err and err.count(" here, ") == 1, err


def test_resume_with_other_code_than_the_interrupted_run_is_refused_naming_both_commits(tmp_path, capfd):
    folder = _interrupted_folder(tmp_path, [*TINY, "--out", str(tmp_path)], commit="0123456789ab" + "0" * 28)
    assert train.main(["--resume", str(folder)]) == 2
    err = capfd.readouterr().err
    assert "the interrupted run ran commit 0123456789ab, this is " in err and "check out its commit" in err
