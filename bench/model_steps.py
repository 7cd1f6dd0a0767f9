"""gpu_bench.py's ``model`` section: the article's table on one GPU, whole training steps at full depth.

OLMoE-1B-7B (16 decoder layers) and Granite-3.1-3B-A800M (32) at their published configurations
(``sonar_kernels.train.PRESETS``), random initialisation (the GPU machine reaches no hub), bf16, the
``make memory-real`` configuration: a batch of 4 x 1024 tokens, activation checkpointing on, and off for
:data:`NO_CHECKPOINTING_ARMS`. One unit per (model, arm, checkpointing), each arm built fresh in its own
unit (the allocator's cache emptied and its peak reset first, so one arm's cache cannot lower another's
peak). The arms, sonar-train's (docs/sonar-train.md):

- ``standard``: torch.optim.AdamW (fused on CUDA) over every parameter, ``clip_grad_norm_`` over all of
  them: the article's baseline;
- ``standard-dense-clip``: the same, clipping only the dense gradients: the bitwise control of sonar;
- ``sonar``: SonarAdamW, the expert update fused into the wgrad epilogue;
- ``paper-inbwd``: the paper's method with torch's AdamW, each batched expert tensor stepped from its
  gradient hook; ``per-expert-inbwd``: one AdamW call per expert slice (the paper's ablation);
- ``sonar-8bit`` and ``sonar-stochastic-8bit``: SonarAdamW with 8-bit expert moments, the second with bf16
  expert weights rounded stochastically (no master copy).

Each row: the median step time over :data:`STEPS` timed steps after warm-up, its p10-p90, tokens/s, the
peak allocated memory of one more step (the optimizer state exists by then: the step ``make memory-real``
traces) and, on CUDA, the peak reserved by the caching allocator; the traced prediction of the same model,
arm and configuration, read from :data:`PREDICTIONS` (computed on the CPU by ``bench/memory_real.py`` and
committed, so the GPU run traces nothing), and measured / predicted; time and memory against standard's
row of the same checkpointing. An arm that does not fit the device is a row ("out of memory", with the
allocator's message and the peak it reached), and the next unit runs.

The bitwise claim: sonar's unit ends by comparing its weights and moments, every parameter and both
moments, with those of standard-dense-clip's unit after the same steps on the same batches (the control's
tensors are kept on the host between the two units). On CUDA every unit runs with torch's deterministic
algorithms where it has them (``torch.use_deterministic_algorithms(True, warn_only=True)``, as sonar-train
sets), so attention's backward sums in a fixed order in both arms.
"""

from __future__ import annotations

import json
import statistics
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

MODELS = ("olmoe-1b-7b", "granite-3.1-3b-a800m")
ARMS = (
    "standard", "standard-dense-clip", "sonar", "paper-inbwd", "per-expert-inbwd", "sonar-8bit",
    "sonar-stochastic-8bit",
)  # fmt: skip
# The arms also run without activation checkpointing (both fit an 80 GB GPU at both models, traced: OLMoE
# 51.9 and 47.6 GiB); the rest only with it, to keep the section inside one call's budget.
NO_CHECKPOINTING_ARMS = ("standard", "sonar")
CONTROL = {"sonar": "standard-dense-clip"}  # compared bit for bit (checkpointing on)
# Each arm's row in bench/memory_real.py's report.
TRACED = {
    "standard": "standard bf16", "standard-dense-clip": "standard dense clip", "sonar": "sonar",
    "paper-inbwd": "paper inbwd", "per-expert-inbwd": "per-expert inbwd", "sonar-8bit": "sonar 8-bit",
    "sonar-stochastic-8bit": "sonar stochastic 8-bit",
}  # fmt: skip
# ``make memory-real``'s one-GPU rows of both models, every arm, checkpointing on and off (the commit that
# traced them is in the file; tests/test_model_steps.py checks that bench/memory_model still predicts them).
PREDICTIONS = ROOT / "bench" / "results" / "memory" / "2026-12-06-cpu-memory-real-one-gpu.json"
# (warm-up, timed) steps by the seam's mode; one more step under the peak follows.
STEPS = {"gpu": (2, 5), "rehearsal": (1, 2), "dry-run": (1, 1)}
# Where measured and predicted peaks are called different (marked "!" in the table: to be explained).
PREDICTION_TOLERANCE = 0.03
# Estimated seconds of a unit on an H100 or H200 (gpu_bench.py's deadline): the model built on the GPU, 8
# steps of 4 x 1024 tokens (OLMoE-1B-7B about 43 TFLOP a step with checkpointing's recomputation, its
# AdamW over 6.9 B parameters about 100 GB of traffic), the allocator emptied. The control and sonar add
# the host copy of 3 x 6.9 B bf16 values (41 GB) and its comparison; the section's first unit adds its
# compilations when the section runs alone (bench/README.md, "Budget").
UNIT_S = {"olmoe-1b-7b": 15, "granite-3.1-3b-a800m": 12}
BITWISE_S = 15
FIRST_UNIT_S = 60


def estimate(name: str) -> float:
    """The deadline's estimate of unit ``name`` (see :data:`UNIT_S`)."""
    model = next(m for m in MODELS if name.startswith(m + " "))
    arm = name.removeprefix(model + " ")
    first = name == f"{MODELS[0]} {ARMS[0]}"
    return (
        UNIT_S[model]
        + (BITWISE_S if arm in (*CONTROL, *CONTROL.values()) else 0)
        + (FIRST_UNIT_S if first else 0)
    )


def load_predictions(path: Path = PREDICTIONS) -> dict[tuple[str, int, str, bool], int]:
    """{(preset, layers, row arm, checkpointing): traced peak bytes} of the report's one-GPU rows."""
    rows = json.loads(path.read_text())["rows"]
    return {
        (r["preset"], r["layers"], r["arm"], r["checkpointing"]): r["peak_bytes"]
        for r in rows
        if r["layout"] == "1 gpu" and "error" not in r
    }


def units(plan, device) -> list[tuple[str, object]]:
    """(unit name, callable) of the section in run order: per model, every arm with checkpointing (standard
    first: the ratios' base; standard-dense-clip before sonar: the bitwise control), then the arms without."""
    section = Section(plan, device)
    out = []
    for model in MODELS:
        for checkpointing in (True, False):
            for arm in ARMS if checkpointing else NO_CHECKPOINTING_ARMS:
                name = f"{model} {arm}" + ("" if checkpointing else " no checkpointing")
                out.append((name, lambda m=model, a=arm, c=checkpointing: section.arm(m, a, c)))
    return out


class Section:
    """What the section's units share: the plan, the device seam, the predictions, each model's standard
    rows (the ratios' base) and the control's tensors on the host until sonar's unit compares them."""

    def __init__(self, plan, device):
        self.plan, self.device = plan, device
        self.predictions = load_predictions()  # committed with the code: a missing file is an error
        self.standard: dict[tuple[str, bool], dict] = {}
        self.controls: dict[str, list[tuple[str, torch.Tensor]]] = {}

    def arm(self, model: str, name: str, checkpointing: bool) -> dict:
        """One arm's row (module docstring)."""
        from sonar_kernels import train
        from sonar_kernels.integrations import transformers as hf
        from sonar_kernels.optim.ownership import UnownedExpertsWarning

        hf.register()
        device, plan = self.device, self.plan
        preset_name = plan.presets[model]
        preset = train.PRESETS[preset_name]
        layers = plan.model_layers or preset.num_layers
        argv = ["--preset", preset_name, "--layers", str(layers), "--device", device.kind, "--quiet",
                "--dtype", "bfloat16", *([] if checkpointing else ["--no-checkpointing"])]  # fmt: skip
        argv += ["--fused"] if device.gpu else []
        args = train.parse_args(argv)
        batch, seq = plan.model_batch or (preset.batch_size, preset.sequence_length)
        data = train.ByteData(train.default_text(), seq, batch, seed=0)
        warm, timed = STEPS[device.mode]
        tokens = [data.batch(i).to(device.kind) for i in range(warm + timed + 1)]
        row = {"model": model, "preset": preset_name, "arm": name, "layers": layers, "checkpointing": checkpointing,
               "batch": batch, "sequence_length": seq, "dtype": "bfloat16"}  # fmt: skip
        if device.mode == "gpu":  # attention's backward in a fixed order (sonar-train's setting)
            torch.use_deterministic_algorithms(True, warn_only=True)
        device.release()  # a fresh state: the previous arms' cache emptied, the peak reset
        built = initial = None
        try:
            with warnings.catch_warnings():
                # standard and the torch in-backward arms train the sonar experts as dense parameters
                warnings.simplefilter("ignore", UnownedExpertsWarning)
                initial = train.build_model(preset, layers, 0, torch.bfloat16, args.device_obj)
                built = train.build_arm(name, initial, args, steps=len(tokens))
                initial = None  # build_arm trains a copy
                row.update(self._steps(train, built, tokens, warm, args.max_grad_norm))
                if name in CONTROL.values() and checkpointing:
                    self.controls[model] = _tensors(built, "cpu")
                if name in CONTROL and checkpointing:
                    row.update(self._compare(model, built))
        except torch.OutOfMemoryError as error:
            row.update(
                out_of_memory=True, message=str(error).splitlines()[0], peak_bytes=device.max_allocated()
            )
        finally:
            del built, initial
            device.release()
        self._derive(model, row)
        return row

    def _steps(self, train, arm, tokens, warm: int, max_grad_norm: float) -> dict:
        device = self.device
        losses = [train.train_step(arm, t, max_grad_norm)[0] for t in tokens[:warm]]
        times = []
        for t in tokens[warm:-1]:
            device.sync()
            start = time.perf_counter()
            losses.append(train.train_step(arm, t, max_grad_norm)[0])
            device.sync()
            times.append(time.perf_counter() - start)
        peak = device.peak_during(lambda: losses.append(train.train_step(arm, tokens[-1], max_grad_norm)[0]))
        p10, p90 = _p10_p90(times)
        median = statistics.median(times)
        return {
            "step_time_s": median, "p10_s": p10, "p90_s": p90, "step_times_s": times,
            "tokens_per_s": tokens[-1].numel() / median, "peak_bytes": peak,
            "reserved_peak_bytes": device.max_reserved(), "steps": len(tokens),
            # each step's training loss, read after the timing (a fake tensor has no value: none in a dry run)
            "losses": None if device.mode == "dry-run" else torch.stack(losses).float().tolist(),
        }  # fmt: skip

    def _compare(self, model: str, arm) -> dict:
        """Sonar's weights and moments against the control's, bit for bit (every parameter, both moments)."""
        control = self.controls.pop(model, None)
        if control is None:
            return {"bitwise_equal_to_control": None, "passed": False,
                    "bitwise_reason": f"{CONTROL['sonar']} did not finish: nothing to compare"}  # fmt: skip
        mine = _tensors(arm, None)
        names = [n for n, _ in mine]
        if names != [n for n, _ in control]:
            return {"bitwise_equal_to_control": False, "passed": False,
                    "bitwise_reason": "the arms hold different tensors"}  # fmt: skip
        differing = [n for (n, a), (_, b) in zip(mine, control, strict=True) if not self.device.equal(a, b)]
        equal = None if self.device.mode == "dry-run" else not differing
        return {
            "bitwise_equal_to_control": equal, "bitwise_tensors": len(names), "bitwise_differing": differing[:20],
            "passed": equal is not False,
        }  # fmt: skip

    def _derive(self, model: str, row: dict) -> None:
        """The prediction and the ratios against standard's row (standard runs first)."""
        key = (row["preset"], row["layers"], TRACED[row["arm"]], row["checkpointing"])
        predicted = self.predictions.get(key)
        row["predicted_peak_bytes"] = predicted
        measured = row.get("peak_bytes")
        row["measured_over_predicted"] = ratio = measured / predicted if predicted and measured else None
        # Beyond the tolerance the row is to be explained (the reserved peak beside it; docs/benchmarks.md).
        row["within_prediction"] = None if ratio is None else abs(ratio - 1) <= PREDICTION_TOLERANCE
        if row["arm"] == "standard":
            self.standard[(model, row["checkpointing"])] = row
        base = self.standard.get((model, row["checkpointing"]), {})
        done = not row.get("out_of_memory") and not base.get("out_of_memory")
        ok = done and base.get("step_time_s") and base.get("peak_bytes")
        row["time_vs_standard"] = row["step_time_s"] / base["step_time_s"] if ok else None
        row["memory_vs_standard"] = row["peak_bytes"] / base["peak_bytes"] if ok else None


def _tensors(arm, to: str | None) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and its exp_avg and exp_avg_sq (wherever the arm's optimizers keep them), in the
    model's order, moved ``to`` a device (a copy) or as they are."""
    out = []
    states = [o.state for o in arm.optimizers]
    for name, p in arm.model.named_parameters():
        state = next((s[p] for s in states if p in s), {})
        for key, tensor in (
            ("", p),
            (".exp_avg", state.get("exp_avg")),
            (".exp_avg_sq", state.get("exp_avg_sq")),
        ):
            if tensor is not None:
                t = tensor.detach()
                out.append((name + key, t.to(to, copy=True) if to else t))
    return out


def _p10_p90(times: list[float]) -> tuple[float, float]:
    if len(times) < 2:
        return times[0], times[0]
    cuts = statistics.quantiles(times, n=10, method="inclusive")
    return cuts[0], cuts[-1]


# --- The readable report --------------------------------------------------------------------------------


def table_lines(units_: dict) -> list[str]:
    """The section's table: one row per unit, by model."""
    lines = []
    for model in MODELS:
        rows = [(n, u) for n, u in units_.items() if n.startswith(model + " ")]
        if not rows:
            continue
        lines += [
            "", f"**{model}**", "",
            "| arm | checkpointing | step ms (p10-p90) | tokens/s | time / standard | peak GiB | traced GiB | "
            "measured / traced | memory / standard | reserved GiB | bitwise |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]  # fmt: skip
        for name, unit in rows:
            arm = name.removeprefix(model + " ").removesuffix(" no checkpointing")
            ck = "off" if name.endswith(" no checkpointing") else "on"
            if unit["status"] != "done":
                why = unit.get("error") or unit.get("reason") or ""
                lines.append(f"| {arm} | {ck} | **{unit['status']}** {why} | | | | | | | | |")
                continue
            lines.append(row_line(arm, ck, unit["result"]))
    return lines


def row_line(arm: str, ck: str, r: dict) -> str:
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
    ratio = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    predicted = gib(r.get("predicted_peak_bytes"))
    if r.get("out_of_memory"):
        return (f"| {arm} | {ck} | out of memory at {gib(r['peak_bytes'])} GiB: {r['message']} | | | | "
                f"{predicted} | | | | |")  # fmt: skip
    bitwise = r.get("bitwise_equal_to_control")
    bitwise = "-" if "bitwise_tensors" not in r and bitwise is None else str(bitwise)
    return (
        f"| {arm} | {ck} | {1000 * r['step_time_s']:.1f} ({1000 * r['p10_s']:.1f}-{1000 * r['p90_s']:.1f}) | "
        f"{r['tokens_per_s']:.0f} | {ratio(r['time_vs_standard'])} | {gib(r['peak_bytes'])} | {predicted} | "
        f"{ratio(r['measured_over_predicted'])}{' !' if r.get('within_prediction') is False else ''} | "
        f"{ratio(r['memory_vs_standard'])} | "
        f"{gib(r.get('reserved_peak_bytes'))} | {bitwise} |"
    )
