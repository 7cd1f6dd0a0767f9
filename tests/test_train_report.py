"""sonar-train's verdicts in words and its memory note, against hand-built results: the effect size first,
a held-out difference below NEGLIGIBLE_DELTA called negligible however many standard errors it is, and
peaks that come out alike explained by what set them."""

import pytest

from sonar_kernels.train import report as report_module
from sonar_kernels.train.memory import LABELS
from sonar_kernels.train.report import NEGLIGIBLE_DELTA, heldout_statistics, memory_note, summary_table
from sonar_kernels.train.verdicts import spike_effect

STANDARD = [2.0, 2.1, 1.9]


def test_a_tiny_difference_many_standard_errors_away_is_negligible_not_a_win():
    assert NEGLIGIBLE_DELTA == 0.001
    # A checkpoint run's case: every seed 1e-5 higher, so the standard error is far smaller still; this
    # read "standard lower by 0.0000 nats per byte (more than 2 standard errors ...)".
    tiny = heldout_statistics(STANDARD, [2.00001, 2.100011, 1.900009])
    assert tiny["negligible"] is True and tiny["negligible_below"] == NEGLIGIBLE_DELTA
    assert abs(tiny["mean_delta"]) > 2 * tiny["standard_error"]
    assert tiny["verdict"].startswith("sonar - standard +1.0e-05 nats per byte ± ")
    assert "negligible (below 0.001 nats per byte" in tiny["verdict"] and "lower by" not in tiny["verdict"]
    # Just above the threshold, the same spread: a detectable difference, the effect first.
    above = heldout_statistics(STANDARD, [2.0012, 2.1012, 1.9013])
    assert above["negligible"] is False
    assert above["verdict"].startswith("standard lower by 0.0012 nats per byte (more than 2 standard errors")
    # Below the threshold but with seeds that spread widely: negligible as measured, and said to be no more.
    noisy = heldout_statistics(STANDARD, [2.0105, 2.0897, 1.9])
    assert noisy["negligible"] is True and 2 * noisy["standard_error"] > NEGLIGIBLE_DELTA
    assert noisy["verdict"].startswith("sonar - standard +0.0001 nats per byte ± 0.00")
    assert "negligible" in noisy["verdict"] and "no difference detectable" in noisy["verdict"]
    # One seed: the difference, negligible or not, and no statistical verdict beyond it.
    one = heldout_statistics([2.0], [2.0004])
    assert one["verdict"].startswith("sonar - standard +0.0004 nats per byte on one seed: negligible")
    assert heldout_statistics([2.0], [2.01])["verdict"].startswith(
        "sonar - standard +0.0100 nats per byte on one seed: no statistical verdict"
    )


def test_the_spike_effect_verdicts_use_the_same_threshold():
    arm = {"seeds": [0, 1, 2], "heldout_losses": STANDARD}
    spiked = {"seeds": [0, 1, 2], "heldout_losses": [2.00001, 2.100011, 1.900009]}
    effect = spike_effect({"arms": {"standard": arm}}, {"arms": {"standard": spiked}}, "base.json")
    verdict = effect["arms"]["standard"]["verdict"]
    assert verdict.startswith("the spiked run - the run without the spike +1.0e-05 nats per byte")
    assert "negligible" in verdict


def _arm(peak: dict, phase: str) -> dict:
    breakdown = dict.fromkeys(LABELS, 0) | peak
    return {"seeds": [0], "heldout_losses": [2.0], "heldout_loss": 2.0, "train_losses": [[3.0, 2.5]],
            "clip_fraction": 0.0, "peak_memory_bytes": sum(breakdown.values()), "peak_memory": breakdown,
            "peak_phase": phase, "step_time": report_module.step_time_summary([[0.1]]), "step_time_s": None}  # fmt: skip


def _report(standard: dict, sonar: dict) -> dict:
    report = {"preset": "tiny-olmoe", "layers": 1, "parameters": 1.1e6, "expert_parameters": 2**20,
              "dtype": "float32", "device": "cpu", "steps": 2, "backend": "torch", "data": "pydoc_data.topics",
              "commit": "unknown", "seeds_run": 1, "arms": {"standard": standard, "sonar": sonar},
              "heldout": heldout_statistics([2.0], [2.0]), "speedup": None, "speedup_note": "no time ratio"}  # fmt: skip
    report["peak_memory_reduction"] = 1 - sonar["peak_memory_bytes"] / standard["peak_memory_bytes"]
    report["peak_memory_note"] = memory_note(report)
    return report


MiB = 2**20


def test_alike_peaks_are_explained_by_what_set_them():
    # A tiny model whose peak falls in the forward: activations set it, no gradient is held yet, so the
    # 4 MiB of expert gradients (2**20 fp32 parameters) that sonar does not keep cannot lower it.
    forward = {"activations": 80 * MiB, "parameters": 12 * MiB, "optimizer_state": 8 * MiB}
    report = _report(_arm(forward, "forward"), _arm(forward, "forward"))
    note = report["peak_memory_note"]
    assert note.startswith(
        "peak memory sonar / standard +0.0 %: standard's peak (100.00 MiB, in the forward)"
    )
    assert "is 80 % activations, 12 % parameters, 8 % optimizer state" in note
    assert "holds no gradients" in note and "(4.00 MiB) cannot lower it" in note
    table = summary_table(report)
    assert note in table and "+0.0%" in table
    assert "peak memory +0.0 % (standard's peak: 80 % activations" in report_module._title(report)
    # Peaks in the backward, 0.4 % apart: the gradients are held, and their share of the peak is given.
    backward = {"activations": 90 * MiB, "gradients": 6 * MiB, "parameters": 4 * MiB}
    sonar = dict(backward, gradients=int(5.6 * MiB))
    note = memory_note(_report(_arm(backward, "backward"), _arm(sonar, "backward")))
    assert note.startswith("peak memory sonar / standard -0.4 %") and "90 % activations" in note
    assert "the expert gradients sonar does not keep (4.00 MiB) are 4.0 % of it" in note


def test_peaks_that_differ_need_no_note():
    standard = _arm({"gradients": 40 * MiB, "optimizer_state": 40 * MiB, "activations": 20 * MiB}, "backward")
    sonar = _arm({"gradients": 2 * MiB, "optimizer_state": 40 * MiB, "activations": 20 * MiB}, "backward")
    report = _report(standard, sonar)
    assert report["peak_memory_note"] is None
    assert report["peak_memory_reduction"] == pytest.approx(0.38)
    assert "standard's peak" not in summary_table(report) and "-38.0%" in summary_table(report)
    assert "standard's peak" not in report_module._title(report)
