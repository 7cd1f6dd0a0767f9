"""Validation: the tiny presets measured with torch's MemTracker on gloo ranks (sonar-train's memory pass, or
this module's arms for EP x DP and FSDP2) and compared with :func:`memory_model.predict`."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

from memory_model.inputs import Layout, Setup, with_layers
from memory_model.layouts import predict

# --- validation: MemTracker on gloo ranks -----------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One measured configuration: a preset (``layers``, ``batch_size``, ``sequence_length`` as run), a
    method, a layout, a dtype, activation checkpointing and torch.optim.AdamW's implementation."""

    preset: str
    method: str
    layout: Layout
    dtype: str = "float32"
    checkpointing: bool = True
    adamw: str = "single"
    layers: int | None = None
    batch_size: int | None = None
    sequence_length: int | None = None
    moments: str = "exact"

    @property
    def backend(self) -> str:
        return "triton" if self.method == "sonar" else "torch"

    def setup(self, presets) -> Setup:
        preset = presets[self.preset]
        return Setup(
            with_layers(preset, self.layers), self.batch_size or preset.batch_size,
            self.sequence_length or preset.sequence_length, self.method, self.layout,
            param_bytes=2 if self.dtype == "bfloat16" else 4, checkpointing=self.checkpointing, adamw=self.adamw,
            backend=self.backend, tracker=True, collectives="gloo", moments=self.moments,
        )  # fmt: skip

    def label(self) -> str:
        return (
            f"{self.preset} {self.layout.name} {self.method} {self.dtype} "
            f"{'ckpt' if self.checkpointing else 'no-ckpt'} adamw-{self.adamw}"
            + (f" moments-{self.moments}" if self.moments != "exact" else "")
        )


# Presets the validation adds to sonar-train's: sonar's fused update runs under the Triton interpreter on
# this CPU, too slow for the tiny presets (a 2-layer model of tiny-olmoe's shape takes minutes per step).
EXTRA_PRESETS = {}


def presets() -> dict:
    """sonar-train's presets (``sonar_kernels.train.data.PRESETS``) and the validation's own."""
    from sonar_kernels.train.data import PRESETS, Preset

    return {
        **PRESETS,
        "micro-olmoe": Preset("olmoe", 64, 64, 8, 2, 2, 4, 4, 256, batch_size=2, sequence_length=32),
        # tiny-olmoe with a 16384-token vocabulary (the byte tokens use 256 of it): the cross-entropy's
        # [T, V] tensors set the peak, as at the real presets' vocabularies
        "tiny-olmoe-v16k": Preset("olmoe", 128, 256, 32, 2, 4, 4, 4, 16384, batch_size=4),
    }


def _args(case: Case):
    from sonar_kernels.train import parse_args

    argv = ["--backend", case.backend, "--quiet", "--dtype", case.dtype]
    if not case.checkpointing:
        argv.append("--no-checkpointing")
    argv += {"single": ["--no-foreach", "--no-fused"], "foreach": ["--foreach", "--no-fused"],
             "fused": ["--no-foreach", "--fused"]}[case.adamw]  # fmt: skip
    if case.layout.ep > 1 and case.layout.dp == 1:
        argv += ["--ep", str(case.layout.ep)]
    return parse_args(argv)


def measure(case: Case) -> dict:
    """MemTracker's peak of one step of ``case`` on this rank, in bytes: ``total``, ``breakdown`` (the
    categories of :data:`CATEGORIES`), ``phase``, and under expert parallelism ``expert_rows`` (the rows
    this rank's experts received per layer in the measured step). Every rank of the job calls it, in the
    same order, with torch.distributed initialized when the layout has several ranks: sonar-train's
    memory pass (``sonar_kernels.train.memory.measure_memory``: two warm-up steps, one tracked) for the
    layouts sonar-train runs (one rank, data parallel, expert parallel), the same procedure on this
    module's arms for EP x DP and FSDP2."""
    import torch

    from sonar_kernels.integrations import transformers as hf
    from sonar_kernels.train import ByteData, build_model, default_text
    from sonar_kernels.train.memory import measure_memory

    hf.register()
    preset = presets()[case.preset]
    args = _args(case)
    dtype = getattr(torch, case.dtype)
    initial = build_model(preset, case.layers, 0, dtype, torch.device("cpu"))
    hf.set_backend(initial, case.backend)
    data = ByteData(default_text(), case.sequence_length or preset.sequence_length,
                    case.batch_size or preset.batch_size, seed=0)  # fmt: skip
    arm = "standard" if case.method == "standard" else "sonar" if case.moments == "exact" else "sonar-8bit"
    calls = _count_routed_rows(initial, case.layout.ep) if case.layout.ep > 1 else None
    if case.layout.fsdp > 1 or (case.layout.ep > 1 and case.layout.dp > 1):
        result = _measure_custom(arm, initial, data, args, case.layout)
    else:
        result = measure_memory(arm, initial, data, args, torch.device("cpu"))
    breakdown = result["peak_memory"]
    expert_rows = None
    if calls is not None:  # the tracked step's forward: the third of three steps
        layers = initial.config.num_hidden_layers
        per_step = layers * (2 if case.checkpointing else 1)  # checkpointing routes again in the backward
        expert_rows = _received_rows(calls[2 * per_step : 2 * per_step + layers], case.layout)
    return {
        "expert_rows": expert_rows,
        "total": result["peak_memory_bytes"],
        "phase": result["peak_phase"],
        "breakdown": {
            "parameters": breakdown["parameters"],
            "buffers": breakdown["buffers"],
            "gradients": breakdown["gradients"],
            "optimizer_state": breakdown["optimizer_state"],
            "optimizer_step_temporaries": breakdown["optimizer_step_temporaries"],
            "activations_and_temporaries": breakdown["activations"]
            + breakdown["temporary"]
            + breakdown["other"],
        },
    }


def _custom_arm(name: str, initial, args, layout: Layout):
    """sonar-train's arm (``sonar_kernels.train.arms.build_arm``) for the layouts sonar-train does not run.

    FSDP2: ``fully_shard`` of every experts module and decoder layer, then of the model (docs/distributed.md,
    "Distributed training"; after activation checkpointing is enabled); ``standard``: torch.optim.AdamW
    and ``clip_grad_norm_`` over every (sharded) parameter; ``sonar``: SonarAdamW, which updates each
    expert shard from FSDP2's reduce-scattered gradient. EP x DP: a (dp, ep) mesh; the experts sharded
    over ``ep`` (``shard_experts``) and replicated over ``dp``; DDP over every rank for the dense
    parameters; ``sonar``: SonarAdamW with ``data_parallel_group=mesh["dp"]``; ``standard``:
    torch.optim.AdamW, the expert gradients averaged over ``dp`` in place after the backward, the global
    norm's expert part summed over ``ep``."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import sonar_kernels
    from sonar_kernels.train.arms import EXPERT_PARAMS, Arm, enable_checkpointing

    model = copy.deepcopy(initial)
    hyper = {"lr": args.lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    flags = {"foreach": args.foreach, "fused": args.fused}
    if args.checkpointing:
        enable_checkpointing(model)
    model.train()
    if layout.fsdp > 1:
        fully_shard_model(model, init_device_mesh("cpu", (layout.fsdp,)))
        if name == "sonar":
            optimizer = sonar_kernels.SonarAdamW(model, **hyper, **flags, max_grad_norm=args.max_grad_norm)
            return Arm(name, model, optimizer, [], None, model)
        optimizer = torch.optim.AdamW(model.parameters(), **hyper, **flags)
        return Arm(name, model, optimizer, [], list(model.parameters()), model)
    from sonar_kernels.integrations import transformers as hf
    from sonar_kernels.optim.distributed import exclude_from_ddp

    mesh = init_device_mesh("cpu", (layout.dp, layout.ep), mesh_dim_names=("dp", "ep"))
    hf.shard_experts(model, mesh["ep"])
    experts = [p for n, p in model.named_parameters() if n.endswith(EXPERT_PARAMS)]
    if name == "sonar":
        optimizer = sonar_kernels.SonarAdamW(model, **hyper, **flags, max_grad_norm=args.max_grad_norm,
                                             data_parallel_group=mesh["dp"])  # fmt: skip
        clip = None
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **hyper, **flags)
        exclude_from_ddp(model, experts)
        clip = list(model.parameters())
    arm = Arm(name, model, optimizer, [], clip, torch.nn.parallel.DistributedDataParallel(model), experts)
    arm.groups = (mesh["dp"].get_group(), mesh["ep"].get_group())
    return arm


def fully_shard_model(model, mesh, mp_policy=None) -> None:
    """FSDP2 as docs/distributed.md's recipe applies it to a transformers MoE model: ``fully_shard`` of
    every decoder layer's experts module, of the layer, then of the model, over ``mesh``, with
    ``mp_policy`` (a MixedPrecisionPolicy; None: FSDP2's default, no casts)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = mp_policy or MixedPrecisionPolicy()
    for layer in model.model.layers:
        experts = next(m for m in layer.modules() if type(m).__name__.endswith("Experts"))
        fully_shard(experts, mesh=mesh, mp_policy=policy)
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def _custom_step(arm, tokens, max_grad_norm: float) -> None:
    """One step of a :func:`_custom_arm` (as ``sonar_kernels.train.arms.train_step``)."""
    import torch
    import torch.distributed as dist

    loss = arm.wrapped(input_ids=tokens, labels=tokens).loss
    loss.backward()
    if arm.clip_params is not None:
        if arm.ep_experts is None:  # FSDP2: DTensor gradients, the norm reduced over the mesh
            torch.nn.utils.clip_grad_norm_(arm.clip_params, max_grad_norm)
        else:
            dp_group, ep_group = arm.groups
            experts = [p.grad for p in arm.ep_experts]
            for grad in experts:  # averaged over the replicas, in place (DDP's arithmetic)
                grad.div_(dist.get_world_size(dp_group))
                dist.all_reduce(grad, group=dp_group)
            dense = [p.grad for p in arm.clip_params if not any(p is q for q in arm.ep_experts)]
            expert_sq = torch.nn.utils.get_total_norm(experts).square()
            dist.all_reduce(expert_sq, group=ep_group)
            norm = torch.sqrt(torch.nn.utils.get_total_norm(dense).square() + expert_sq)
            torch.nn.utils.clip_grads_with_norm_(arm.clip_params, max_grad_norm, norm)
    arm.optimizer.step()
    arm.optimizer.zero_grad(set_to_none=True)


def _measure_custom(name: str, initial, data, args, layout: Layout) -> dict:
    """``sonar_kernels.train.memory.measure_memory``'s procedure (two untracked steps, then one tracked
    by MemTracker, ``track_step``) on a :func:`_custom_arm`."""
    import functools

    import torch

    from sonar_kernels.train import distributed
    from sonar_kernels.train.memory import track_step

    arm = _custom_arm(name, initial, args, layout)
    for step in range(2):
        _custom_step(arm, data.batch(distributed.batch_index(step)), args.max_grad_norm)
    tokens = data.batch(distributed.batch_index(2))
    step = functools.partial(_custom_step, arm, tokens, args.max_grad_norm)
    return track_step(arm.model, arm.optimizers, step, torch.device("cpu"))


def _count_routed_rows(model, ep: int) -> list:
    """Record, for every forward of a router of ``model`` (and of its copies: the hooks are copied with
    it), how many of this rank's routed slots go to each of the ``ep`` expert-parallel ranks. Counted in
    Python from the top-k ids (no tensor is allocated, so the measurement is unchanged)."""
    calls = []
    experts = (
        model.config.num_experts if hasattr(model.config, "num_experts") else model.config.num_local_experts
    )
    local = experts // ep

    def hook(module, inputs, output):
        counts = [0] * ep
        for expert in output[2].reshape(-1).tolist():
            counts[expert // local] += 1
        calls.append(counts)

    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(hook)
    return calls


def _received_rows(calls: list, layout: Layout) -> list[int]:
    """Per layer, the rows this rank's experts receive: the slots every rank of its expert-parallel group
    routes to it (``calls``: this rank's per-layer counts to each rank of the group)."""
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, calls)
    rank = dist.get_rank()
    group = [r for r in range(dist.get_world_size()) if r // layout.ep == rank // layout.ep]
    return [sum(every[r][layer][rank % layout.ep] for r in group) for layer in range(len(calls))]


def _rank_main(rank: int, world: int, port: int, cases: list, out: str) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before sonar_kernels is imported (CPU: the interpreter)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))  # fmt: skip
    try:
        import gc

        results = []
        for case in cases:
            gc.collect()  # the previous case's models and optimizers (DDP's reference cycles) go first
            mine = measure(case)
            every = [mine]
            if world > 1:
                every = [None] * world
                dist.all_gather_object(every, mine)
            results.append(every)
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        import gc

        gc.collect()
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort an interpreter's finalization (see tests/ranks.py)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_cases(cases: list[Case], timeout: float = 1800) -> list[list[dict]]:
    """Measure ``cases`` (all of one world size) on that many spawned ranks (gloo on this CPU): per case,
    every rank's :func:`measure`. Raises RuntimeError when a rank fails, TimeoutError past ``timeout`` s
    (the ranks are killed either way)."""
    import tempfile

    import torch.multiprocessing as mp

    world = cases[0].layout.ranks
    if any(c.layout.ranks != world for c in cases):
        raise ValueError("run_cases takes cases of one world size")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "results.json")
        context = mp.start_processes(_rank_main, args=(world, _free_port(), cases, out), nprocs=world,
                                     join=False, start_method="spawn")  # fmt: skip
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(cases)} cases on {world} ranks ran past {timeout} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:  # a rank raised or died
            raise RuntimeError(f"a rank failed: {error}") from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        if not Path(out).exists():
            raise RuntimeError(
                f"the ranks exited without results ({[p.exitcode for p in context.processes]})"
            )
        return json.loads(Path(out).read_text())


def compare(case: Case, measured: list[dict]) -> dict:
    """The prediction of ``case`` against every rank's measurement (under expert parallelism each rank's
    prediction takes the rows its experts received in the measured step): totals, breakdowns, and the
    worst relative error of the total over the ranks."""
    ranks = []
    for m in measured:
        setup = dataclasses.replace(case.setup(presets()), expert_rows=m.get("expert_rows"))
        predicted = predict(setup)
        ranks.append({
            "predicted": {"total": predicted.total, "phase": predicted.phase, "breakdown": predicted.breakdown},
            "measured": m,
            "relative_error": (predicted.total - m["total"]) / m["total"],
        })  # fmt: skip
    return {
        "case": dataclasses.asdict(case) | {"layout": case.layout.name, "ranks": case.layout.ranks},
        "label": case.label(),
        "ranks": ranks,
        "relative_error": max((r["relative_error"] for r in ranks), key=abs),
    }


VALIDATION_LAYOUTS = (
    Layout(), Layout(dp=2), Layout(dp=4), Layout(ep=2), Layout(ep=4), Layout(dp=2, ep=2), Layout(fsdp=2),
    Layout(fsdp=4),
)  # fmt: skip


def validation_cases() -> list[Case]:
    """The measured configurations: sonar-train's tiny presets (4 layers, batch 4 x 128) on every layout of
    :data:`VALIDATION_LAYOUTS`, fp32 and bf16, with and without activation checkpointing, standard and the
    paper's method (the torch backend, single-tensor AdamW: the CPU path); torch.optim.AdamW's foreach and
    fused implementations on one rank; sonar's fused update (the Triton interpreter) on a 2-layer model
    of H 64, I 64, E 8 (``micro-olmoe``, batch 2 x 32) on one rank, DP 2 and EP 2; and tiny-olmoe with a
    16384-token vocabulary (``tiny-olmoe-v16k``), where the cross-entropy's [T, V] tensors set the peak
    as they do at the real vocabularies, on one rank, DP 2, EP 2 and FSDP2 2."""
    cases = [
        Case(preset, method, layout, dtype, checkpointing)
        for layout in VALIDATION_LAYOUTS
        for preset in ("tiny-olmoe", "tiny-granitemoe")
        for dtype in ("float32", "bfloat16")
        for checkpointing in (True, False)
        for method in ("standard", "paper")
    ]
    cases += [Case("tiny-olmoe", method, Layout(), adamw=adamw) for adamw in ("foreach", "fused")
              for method in ("standard", "paper")]  # fmt: skip
    cases += [Case("micro-olmoe", "sonar", Layout(), dtype, checkpointing)
              for dtype in ("float32", "bfloat16") for checkpointing in (True, False)]  # fmt: skip
    cases += [Case("micro-olmoe", "sonar", Layout(dp=2)), Case("micro-olmoe", "sonar", Layout(ep=2))]
    cases += [Case("tiny-olmoe-v16k", method, Layout(), dtype, checkpointing) for dtype in ("float32", "bfloat16")
              for checkpointing in (True, False) for method in ("standard", "paper")]  # fmt: skip
    cases += [Case("tiny-olmoe-v16k", method, layout) for layout in (Layout(dp=2), Layout(ep=2), Layout(fsdp=2))
              for method in ("standard", "paper")]  # fmt: skip
    return cases


def _environment() -> dict:
    import platform

    import torch
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parents[1], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=Path(__file__).parents[1],
                                    capture_output=True, text=True, timeout=10, check=True).stdout.strip())  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "unknown", None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "working_tree_modified": dirty,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "backend": "gloo ranks on this CPU; the Triton kernels under TRITON_INTERPRET=1",
    }


def validate(cases: list[Case] | None = None, progress=print) -> dict:
    """Measure ``cases`` (default :func:`validation_cases`) with MemTracker, one spawned job per layout,
    and compare each with :func:`predict`. Returns the report: the environment, every comparison, and
    the worst relative error of the total per layout and per (layout, method)."""
    cases = cases if cases is not None else validation_cases()
    groups: dict[Layout, list[Case]] = {}
    for case in cases:
        groups.setdefault(case.layout, []).append(case)
    comparisons, retried = [], []
    for layout, group in groups.items():
        start = time.monotonic()
        try:
            measured = run_cases(group)
        except RuntimeError as error:  # once more, on fresh ranks (see the report's "retried")
            progress(f"{layout.name}: a rank failed ({str(error).strip().splitlines()[-1][:200]}); again")
            retried.append({"layout": layout.name, "error": str(error).strip().splitlines()[-1]})
            measured = run_cases(group)
        for case, ranks in zip(group, measured, strict=True):
            comparisons.append(compare(case, ranks))
        progress(f"{layout.name}: {len(group)} cases in {time.monotonic() - start:.0f} s")
    worst: dict = {}
    for c in comparisons:
        for key in (c["case"]["layout"], f"{c['case']['layout']} {c['case']['method']}"):
            if abs(c["relative_error"]) >= abs(worst.get(key, 0.0)):
                worst[key] = c["relative_error"]
    return {**_environment(), "worst_relative_error": worst, "retried": retried, "comparisons": comparisons}
