"""Peak memory of one training step at the real sizes, traced on a CPU without allocating it (issue 44).

``make memory-real`` (``python bench/memory_real.py``): for each preset at its published configuration
(OLMoE-1B-7B, Granite-3.1-3B-A800M, Qwen3-30B-A3B; random initialisation, full depth), each arm and each
layout (one GPU; FSDP2, and expert parallelism with the dense layers on FSDP2, over 4 and 8 ranks, one rank
of a fake process group traced: :data:`LAYOUTS`), one training step of
sonar-train's code, traced by torch's MemTracker under FakeTensorMode (bench/dry_run.py: tensors with
shapes and no storage; the library's Triton backend takes its GPU path, its custom ops run their
launchers and allocate what they allocate on a GPU, and no kernel runs). The step traced is the second
(the first creates the optimizer state), activation checkpointing on and off, 4 x 1024 tokens per rank
(the presets' batch).

Arms (sonar-train's, docs/sonar-train.md), every model in bf16:

- ``standard mixed precision``: on one GPU sonar-train's ``mixed-precision`` (fp32 master copies and
  fp32 moments of every parameter); under FSDP2 FSDP2's own recipe (fp32 shards,
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``); global-norm clipping;
- ``standard bf16``: ``standard``, torch.optim.AdamW on the bf16 parameters (bf16 moments), global clipping;
- ``paper``: the Sonar-MoE paper's method (SonarAdamW's split path with the whole gradient,
  ``split_scratch(fraction=1)``: each expert gradient a tensor, applied in the backward, released);
- ``sonar``: AdamW fused into the wgrad epilogue (no expert gradient);
- ``sonar split``: the split path at the library's bound (``fused_epilogue=False``: one chunk of experts'
  gradient at a time, at most 1/8 of the tensor's or 64 MiB), the path SonarAdamW's default
  (``fused_epilogue=None``) may pick on CUDA: its peak bounds the default's. One GPU only
  (:data:`ONE_GPU_ONLY`);
- ``sonar 8-bit``, ``sonar remainder``, ``sonar stochastic``, ``sonar remainder 8-bit``,
  ``sonar stochastic 8-bit``: the state kinds (docs/design.md); under FSDP2 the 8-bit and stochastic ones
  are not traced (:data:`FSDP2_UNTRACED`).

Under expert parallelism (layout "ep fsdp2", :func:`ep_fsdp2_arm`: the arms of :data:`EP_ARMS`) routing is
balanced, inside the trace only: each rank sends T * top_k / P rows to each of the P ranks and receives as
many (:class:`BalancedDispatch`, which stands in for the dispatch's host read of the all-to-all counts,
``sonar_kernels.nn.expert_parallel.exchange_counts``; docs/distributed.md, "Expert parallel with the dense
layers on FSDP2, traced").

``--loss-chunk-tokens N`` traces every row with sonar-train's chunked loss (``sonar_kernels/train/loss.py``;
the rows then carry ``loss_chunk_tokens``, and the memory model predicts them with it).

``--real`` runs the same code with real CPU tensors (kernels not run, matrix products not computed:
every allocation is real, the values are not); ``--check`` (``make memory-real-check``) runs every row at
reduced depth (``--layers 1 2``) fake and real and compares them (:func:`check`; the layouts of
``--world-sizes`` and ``--layouts``: one rank of a fake process group, whose collectives allocate their
outputs and fill nothing). The traces run in
``--jobs`` processes.

Writes ``runs/memory-real/report.json`` (``--out``): ``{"rows": [...], "commit", "versions", "date"}``, each
row with ``preset``, ``layers``, ``layout`` (:data:`LAYOUTS`), ``world_size``, ``precision``, ``arm``,
``checkpointing``, ``peak_bytes`` (the trace), ``model_peak_bytes`` (bench/memory_model's prediction),
``parameters``, ``mode`` ("fake" or "real"), the peak's ``breakdown`` by MemTracker's categories and its
``phase``, and the ``seconds`` the trace took (an expert-parallel row also its ``dispatch``, its
``expert_gradient_bytes`` and the model's ``model_expert_gradients_at_peak``: :func:`_ep_fields`); and
``report.md``: docs/distributed.md's decision table (:func:`decision_table`), then every row
(:func:`table`), then the expert-parallel savings (:func:`ep_table`). Its limits (docs/distributed.md, "Traced at full
size"): an allocation trace, not the CUDA caching allocator (rounding, fragmentation), and no NCCL buffers
or cuBLAS workspaces.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import multiprocessing
import os
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

PRESETS = ("olmoe-1b-7b", "granite-3.1-3b-a800m", "qwen3-30b-a3b")
# Row name: (sonar-train's arm, precision label, the memory model's method and options, or None).
ARMS = {
    "standard mixed precision": ("mixed-precision", "bf16 model, fp32 masters and moments", None),
    "standard bf16": ("standard", "bf16", {"method": "standard"}),
    "paper": ("paper", "bf16", {"method": "paper"}),
    "sonar": ("sonar", "bf16", {"method": "sonar"}),
    # standard training's bitwise control (dense clipping) and the paper's method with torch's AdamW from
    # each expert tensor's hook, batched or per expert slice (sonar_kernels/train/in_backward.py)
    "standard dense clip": ("standard-dense-clip", "bf16", {"method": "standard"}),
    "paper inbwd": ("paper-inbwd", "bf16", {"method": "paper"}),
    "per-expert inbwd": ("per-expert-inbwd", "bf16", {"method": "paper"}),
    # sonar-train's paper arm at the library's scratch bound instead of the whole gradient (trace())
    "sonar split": ("paper", "bf16", {"method": "sonar", "fused_epilogue": False}),
    "sonar 8-bit": ("sonar-8bit", "bf16, 8-bit expert moments", {"method": "sonar", "moments": "8bit"}),
    "sonar remainder": ("sonar-remainder", "bf16 + 16-bit remainder", {"method": "sonar", "master": "remainder"}),
    "sonar stochastic": ("sonar-stochastic", "bf16, stochastic rounding", {"method": "sonar", "master": "stochastic"}),
    "sonar remainder 8-bit": ("sonar-remainder-8bit", "bf16 + remainder, 8-bit moments",
                              {"method": "sonar", "master": "remainder", "moments": "8bit"}),
    "sonar stochastic 8-bit": ("sonar-stochastic-8bit", "bf16 stochastic, 8-bit moments",
                               {"method": "sonar", "master": "stochastic", "moments": "8bit"}),
}  # fmt: skip


# The layouts (the row's "layout"): one GPU; FSDP2 over the ranks (fsdp2_arm); expert parallelism over the
# ranks with the dense layers on FSDP2 over the same ranks (ep_fsdp2_arm), balanced routing
# (BalancedDispatch).
LAYOUTS = ("1 gpu", "fsdp2", "ep fsdp2")
# The arms traced under EP x FSDP2-dense (the others: sonar-train's --ep has them, the decision is these).
EP_ARMS = ("standard bf16", "paper", "sonar", "sonar 8-bit")


# Arms not traced under FSDP2: their update of a sharded expert tensor (the .grad path's 8-bit moments and
# stochastic rounding, sonar_kernels/ops/torch_backend/fp64_update.py's adamw_8bit_ and stochastic_adamw_
# stochastic_adamw_) runs as torch ops over slices of UPDATE_ELEMENTS (16384) elements, some 40 ops a
# slice: a Qwen3-30B-A3B expert shard is ~6000 slices, hours of fake dispatch per step (and as many kernel
# launches on a GPU, the speed issue 48 owns). The memory model predicts them.
FSDP2_UNTRACED = {
    "sonar 8-bit", "sonar stochastic", "sonar remainder 8-bit", "sonar stochastic 8-bit",
}  # fmt: skip


# Arms traced on one GPU only: under FSDP2 SonarAdamW updates an expert shard from its reduced gradient (the
# .grad path), which has no split path: the row would be sonar's.
# torch's AdamW in the backward (paper inbwd, per-expert inbwd) updates from the local gradient: one
# process only (sonar-train refuses it on several).
ONE_GPU_ONLY = {"sonar split", "paper inbwd", "per-expert inbwd"}


def trace(
    preset_name: str,
    arm: str,
    layers: int | None,
    checkpointing: bool,
    fake: bool = True,
    world_size: int = 1,
    dims=None,
    layout: str | None = None,
    loss_chunk_tokens: int | None = None,
) -> dict:
    """One row: the second training step of ``arm`` on ``preset_name`` (``layers`` decoder layers, all when
    None) under MemTracker, in bf16, on one rank of ``world_size``, in ``layout`` (:data:`LAYOUTS`; None:
    "1 gpu" on one rank, else "fsdp2"; see the module docstring). ``dims``: a ``sonar_kernels.train.Preset``
    traced and predicted under ``preset_name`` instead of its own dimensions (tests/test_memory_real.py),
    restored after the row. ``loss_chunk_tokens``: the step's loss over chunks of that many tokens
    (sonar-train's ``--loss-chunk-tokens``, ``sonar_kernels.train.loss``); None: transformers' loss."""
    layout = layout or ("1 gpu" if world_size == 1 else "fsdp2")
    if layout not in LAYOUTS or (layout == "1 gpu") != (world_size == 1):
        raise ValueError(
            f"layout {layout!r} on {world_size} ranks: one of {LAYOUTS}, '1 gpu' on one rank only"
        )
    if dims is not None:
        from sonar_kernels.train import data

        saved, data.PRESETS[preset_name] = data.PRESETS[preset_name], dims
        try:
            return trace(
                preset_name, arm, layers, checkpointing, fake, world_size, None, layout, loss_chunk_tokens
            )
        finally:
            data.PRESETS[preset_name] = saved
    os.environ["SONAR_KERNELS_TUNING"] = "0"
    warnings.simplefilter("ignore")
    import dry_run
    import torch
    import torch.distributed as dist

    from sonar_kernels import train
    from sonar_kernels.integrations import transformers as hf
    from sonar_kernels.train.memory import track_step

    hf.register()
    start = time.perf_counter()
    preset = train.PRESETS[preset_name]
    depth = layers or preset.num_layers
    sonar_arm, precision, _ = ARMS[arm]
    argv = ["--preset", preset_name, "--layers", str(depth), "--device", "cpu", "--dtype", "bfloat16",
            "--quiet", "--fused", *([] if checkpointing else ["--no-checkpointing"]),
            *([] if loss_chunk_tokens is None else ["--loss-chunk-tokens", str(loss_chunk_tokens)])]  # fmt: skip
    args = train.parse_args(argv)
    if world_size > 1:  # one rank of world_size; the collectives do nothing (their outputs are allocated)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
        mesh = init_device_mesh("cpu", (world_size,))  # real tensors: before the fake mode
    dispatch = BalancedDispatch()
    try:
        with dry_run.dry_run(fake=fake) as launches, dispatch.patched(layout == "ep fsdp2"):
            data = train.ByteData(train.default_text(), preset.sequence_length, preset.batch_size, seed=0)
            mixed_fsdp = world_size > 1 and sonar_arm == "mixed-precision"
            dtype = torch.float32 if mixed_fsdp else torch.bfloat16
            initial = train.build_model(preset, depth, 0, dtype, args.device_obj)
            parameters = sum(p.numel() for p in initial.parameters())
            if layout == "ep fsdp2":
                built = ep_fsdp2_arm(sonar_arm, initial, args, mesh)
            elif world_size > 1:
                built = fsdp2_arm(sonar_arm, initial, args, mesh)
            else:
                built = train.build_arm(sonar_arm, initial, args, steps=2)
                if arm == "sonar split":  # the paper arm's split path, at the library's scratch bound
                    built.split_fraction = None
            del initial
            built.loss_chunk_tokens = loss_chunk_tokens  # the arms built here as build_arm builds them
            train.train_step(built, data.batch(0), args.max_grad_norm)  # creates the optimizer state
            masters = getattr(built.optimizer, "masters", None)  # Fp32Masters' fp32 copies: parameters too
            step = functools.partial(train.train_step, built, data.batch(1), args.max_grad_norm)
            result = track_step(built.model, built.optimizers, step, torch.device("cpu"),
                                modules=() if masters is None else (masters,))  # fmt: skip
    finally:
        if world_size > 1:
            dist.destroy_process_group()
    return {
        "preset": preset_name, "layers": depth, "layout": layout, "world_size": world_size,
        "precision": "fp32 sharded, bf16 compute, fp32 moments" if mixed_fsdp else precision, "arm": arm,
        "checkpointing": checkpointing, "peak_bytes": result["peak_memory_bytes"],
        "model_peak_bytes": model_peak(preset_name, arm, depth, checkpointing, world_size, layout, loss_chunk_tokens),
        "parameters": parameters, "mode": "fake" if fake else "real", "breakdown": result["peak_memory"],
        "phase": result["peak_phase"], "library_host_reads": sorted(set(launches.library_reads)),
        "seconds": time.perf_counter() - start, **({} if loss_chunk_tokens is None else {"loss_chunk_tokens": loss_chunk_tokens}),
        **(_ep_fields(dispatch, built, preset_name, arm, depth, checkpointing, world_size, loss_chunk_tokens) if layout == "ep fsdp2" else {}),
    }  # fmt: skip


def fsdp2_arm(name: str, model, args, mesh):
    """sonar-train's arm ``name`` on ``model`` sharded by FSDP2 over the 1-D device ``mesh``, as
    docs/distributed.md's recipe shards it: activation checkpointing first, then ``fully_shard`` of every
    experts module, every decoder layer and the model. ``standard``: torch.optim.AdamW and global-norm
    clipping over the sharded parameters; ``mixed-precision``: the same over fp32 sharded parameters with
    FSDP2's MixedPrecisionPolicy (bf16 all-gathered parameters and compute, fp32 gradient reduction: the
    usual FSDP2 recipe, torchtitan's default); the others: SonarAdamW with sonar-train's options, which
    updates each expert shard from FSDP2's reduce-scattered gradient."""
    import torch
    from memory_model.validation import fully_shard_model
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import sonar_kernels
    from sonar_kernels.train.arms import SONAR_ARMS, Arm, enable_checkpointing

    if args.checkpointing:
        enable_checkpointing(model)
    model.train()
    policy = None
    if name == "mixed-precision":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard_model(model, mesh, policy)
    hyper = {"lr": args.lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    if name in SONAR_ARMS:
        master = next((m for m in ("remainder", "stochastic") if m in name), None)
        optimizer = sonar_kernels.SonarAdamW(
            model, **hyper, fused=True, max_grad_norm=args.max_grad_norm,
            moments_dtype="8bit" if name.endswith("8bit") else None, master_weights=master,
            fused_epilogue=name != "paper",
        )  # fmt: skip
        arm = Arm(name, model, optimizer, [], None, model)
        arm.split_fraction = 1 if name == "paper" else None  # as build_arm (no split path under FSDP2)
        return arm
    optimizer = torch.optim.AdamW(model.parameters(), **hyper, fused=True)
    return Arm("standard", model, optimizer, [], list(model.parameters()), model)


class BalancedDispatch:
    """Balanced routing for the expert-parallel rows: each rank sends ``S / P`` of its ``S`` = T * top_k
    routed slots to every one of the ``P`` ranks and receives as many, in every layer (so its local experts
    receive S rows a layer, the average of any routing). Inside :meth:`patched` it replaces
    ``sonar_kernels.nn.expert_parallel.exchange_counts`` (the counts of the all-to-all, their exchange and
    their host read: a fake tensor has no values to count or read) with those counts, after the same
    all-to-all of a [P] int64 counts tensor (allocated, moved by nothing under the fake process group); the
    rest of the dispatch runs as it is. It records the split sizes each exchange returned and the rows each
    call of the local experts received (:meth:`record`). Outside the block the library's path is its own."""

    def __init__(self):
        self.splits: list[tuple[list[int], list[int]]] = []
        self.expert_rows: list[int] = []

    @contextlib.contextmanager
    def patched(self, active: bool = True):
        if not active:
            yield self
            return
        from sonar_kernels.nn import expert_parallel

        moe_mlp = expert_parallel.moe_mlp

        def local_experts(x, *args, **kwargs):
            self.expert_rows.append(x.shape[0])
            return moe_mlp(x, *args, **kwargs)

        with (
            mock.patch.object(expert_parallel, "exchange_counts", self.exchange),
            mock.patch.object(expert_parallel, "moe_mlp", local_experts),
        ):
            yield self

    def exchange(self, dest, group) -> tuple[list[int], list[int]]:
        import torch
        import torch.distributed as dist

        size, slots = dist.get_world_size(group), dest.shape[0]
        if slots % size:
            raise ValueError(f"balanced routing needs the slots ({slots}) divisible by the ranks ({size})")
        counts = dest.new_empty(size)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        send, recv = [slots // size] * size, [slots // size] * size
        self.splits.append((send, recv))
        return send, recv

    def record(self) -> dict:
        """The distinct splits the exchanges returned and rows the local-experts calls received, and how many
        exchanges there were (layers x forwards over both steps traced, recomputations included)."""
        return {"exchanges": len(self.splits), "splits": sorted({(tuple(a), tuple(b)) for a, b in self.splits}),
                "expert_rows": sorted(set(self.expert_rows))}  # fmt: skip


class DenseAndExperts:
    """torch.optim.AdamW (fused) as standard training runs it under EP x FSDP2-dense: one over FSDP2's
    sharded dense parameters (DTensors), one over this rank's expert tensors (plain tensors: torch's fused
    AdamW takes one kind or the other in a call); stepped and zeroed together."""

    def __init__(self, dense, experts, hyper: dict):
        import torch

        self.optimizers = [torch.optim.AdamW(dense, **hyper, fused=True),
                           torch.optim.AdamW(experts, **hyper, fused=True)]  # fmt: skip

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none)


def ep_fsdp2_arm(name: str, model, args, mesh):
    """sonar-train's arm ``name`` on ``model`` under expert parallelism over the 1-D ``mesh`` with the dense
    layers on FSDP2 over the same ranks (docs/distributed.md, "Expert parallel with the dense layers on
    FSDP2"): this rank's experts of every layer (``integrations.transformers.shard_experts``, sonar-train's
    ``--ep`` path), activation checkpointing, then ``fully_shard`` of every decoder layer and of the model
    with the expert tensors in ``ignored_params``: the layout ``sonar_kernels.nn.fully_shard_dense`` builds
    (which takes ``SonarExperts`` modules; the transformers experts here are sharded by ``shard_experts``).
    ``standard``: torch.optim.AdamW (:class:`DenseAndExperts`), the expert gradients in ``.grad``, clipped
    globally as sonar-train's ``train_step`` does under ``--ep`` (the experts' squared norms summed over the
    ranks); the sonar arms: SonarAdamW built after sharding, the experts updated in the backward (no
    gradient collective), the dense shards clipped and updated in ``step()``."""
    from torch.distributed.fsdp import fully_shard

    import sonar_kernels
    from sonar_kernels.integrations import transformers as hf
    from sonar_kernels.train.arms import SONAR_ARMS, Arm, enable_checkpointing
    from sonar_kernels.train.in_backward import EXPERT_PARAMS

    hf.shard_experts(model, mesh)
    experts = [p for n, p in model.named_parameters() if n.endswith(EXPERT_PARAMS)]
    if args.checkpointing:
        enable_checkpointing(model)
    model.train()
    ignored = set(experts)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=ignored)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    hyper = {"lr": args.lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    if name in SONAR_ARMS:
        optimizer = sonar_kernels.SonarAdamW(
            model, **hyper, fused=True, max_grad_norm=args.max_grad_norm,
            moments_dtype="8bit" if name.endswith("8bit") else None, fused_epilogue=name != "paper",
        )  # fmt: skip
        arm = Arm(name, model, optimizer, [], None, model, experts)
        arm.split_fraction = 1 if name == "paper" else None  # as build_arm
        return arm
    if name != "standard":
        raise ValueError(f"arm {name!r} is not traced under EP x FSDP2-dense (EP_ARMS)")
    dense = [p for p in model.parameters() if not any(p is q for q in experts)]
    optimizer = DenseAndExperts(dense, experts, hyper)
    return Arm("standard", model, optimizer, [], list(model.parameters()), model, experts)


def _ep_fields(
    dispatch: BalancedDispatch,
    built,
    preset_name,
    arm,
    layers,
    checkpointing,
    world_size,
    loss_chunk_tokens=None,
) -> dict:
    """An expert-parallel row's own fields: the dispatch's record (:meth:`BalancedDispatch.record`), the
    bytes of this rank's expert gradients had they all been kept (its local experts' gate_up_proj and
    down_proj elements x their element size: 2 in bf16), and the expert-gradient bytes alive at the memory
    model's peak (:func:`model_expert_gradients`)."""
    prediction = model_prediction(
        preset_name, arm, layers, checkpointing, world_size, "ep fsdp2", loss_chunk_tokens
    )
    return {"dispatch": dispatch.record(),
            "expert_gradient_bytes": sum(p.numel() * p.element_size() for p in built.ep_experts),
            "model_expert_gradients_at_peak": model_expert_gradients(prediction)}  # fmt: skip


def model_peak(
    preset_name: str,
    arm: str,
    layers: int,
    checkpointing: bool,
    world_size: int = 1,
    layout: str | None = None,
    loss_chunk_tokens: int | None = None,
) -> int:
    """bench/memory_model's prediction of the row (one rank of ``world_size`` in ``layout``, as
    :func:`trace`; the Triton backend, torch's fused AdamW, allocations as the trace sees them; balanced
    routing under expert parallelism; the chunked loss of ``loss_chunk_tokens``); it models every preset and
    arm."""
    return model_prediction(
        preset_name, arm, layers, checkpointing, world_size, layout, loss_chunk_tokens
    ).total


def model_expert_gradients(prediction) -> int:
    """The expert-gradient bytes alive at a prediction's peak: those kept in ``.grad`` so far and the
    current layer's being written (the memory model's terms)."""
    terms = prediction.terms
    return sum(terms.get(name, 0) for name in ("expert_gradients", "grad:gate_up_proj", "grad:down_proj"))


def model_prediction(
    preset_name: str,
    arm: str,
    layers: int,
    checkpointing: bool,
    world_size: int = 1,
    layout: str | None = None,
    loss_chunk_tokens: int | None = None,
):
    """:func:`model_peak`'s ``memory_model.Prediction`` (its terms name what is alive at the peak)."""
    import dataclasses

    from memory_model import Layout, predict, with_layers
    from memory_model.report import real_setup

    options, precision, masters = ARMS[arm][2], "bf16", False
    if arm == "standard mixed precision":
        # FSDP2: fp32 shards under MixedPrecisionPolicy (bf16 compute, fp32 reduction); one GPU: the bf16
        # model with Fp32Masters' fp32 copies and moments (sonar_kernels/train/arms.py).
        options = {"method": "standard"}
        precision, masters = ("fp32 master, bf16 activations", False) if world_size > 1 else ("bf16", True)
    layout = layout or ("1 gpu" if world_size == 1 else "fsdp2")
    if layout == "ep fsdp2":
        layout = Layout(ep=world_size, fsdp=world_size)
    else:
        layout = Layout(fsdp=world_size) if world_size > 1 else Layout()
    setup = real_setup(
        preset_name, options["method"], layout, precision, checkpointing, options.get("moments", "exact")
    )
    setup = dataclasses.replace(
        setup, master=options.get("master"), fp32_masters=masters, dims=with_layers(setup.dims, layers),
        fused_epilogue=options.get("fused_epilogue", True), loss_chunk_tokens=loss_chunk_tokens,
    )  # fmt: skip
    return predict(setup)


def _run(task: tuple) -> dict:
    try:
        return trace(*task)
    except Exception as error:  # recorded in the report; the other rows go on
        preset, arm, layers, checkpointing, fake, world_size = task[:6]
        layout = task[7] if len(task) > 7 and task[7] else "1 gpu" if world_size == 1 else "fsdp2"
        return {"preset": preset, "arm": arm, "layers": layers, "checkpointing": checkpointing,
                "world_size": world_size, "layout": layout, "mode": "fake" if fake else "real",
                "error": f"{type(error).__name__}: {error}"}  # fmt: skip


def run(tasks: list[tuple], jobs: int) -> list[dict]:
    """The rows of ``tasks`` ((preset, arm, layers, checkpointing, fake, world_size[, dims[, layout]]) each,
    :func:`trace`'s arguments), in ``jobs``
    spawned processes (nothing inherited; each trace inside its own dry run, whose patches it undoes), in
    the order given."""
    env_interpret = os.environ.pop("TRITON_INTERPRET", None)  # the GPU path, not the interpreter
    try:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            rows = []
            for row in pool.map(_run, tasks):
                rows.append(row)
                _print_row(row)
            return rows
    finally:
        if env_interpret is not None:
            os.environ["TRITON_INTERPRET"] = env_interpret


def _print_row(row: dict) -> None:
    if "error" in row:
        print(
            f"{row['preset']:22} {row['arm']:24} W={row['world_size']} ck={row['checkpointing']!s:5} {row['mode']}: "
            f"{row['error']}",
            flush=True,
        )
        return
    model = (
        ""
        if row["model_peak_bytes"] is None
        else f"  model {row['model_peak_bytes'] / 2**30:8.2f} GiB ({row['model_peak_bytes'] / row['peak_bytes'] - 1:+.1%})"
    )
    print(f"{row['preset']:22} {row['arm']:24} L={row['layers']:<3} {row['layout']:8} W={row['world_size']} ck={row['checkpointing']!s:5} {row['mode']}: "
          f"{row['peak_bytes'] / 2**30:8.2f} GiB ({row['phase']}, {row['seconds']:.0f} s){model}", flush=True)  # fmt: skip


# GPU memory sizes a reader chooses between (GB, 10^9 bytes, as sold) and the share of one a step may
# take (the rest: the CUDA context, the caching allocator's rounding and fragmentation, NCCL's buffers).
GPU_SIZES_GB = (24, 48, 80, 141)
USABLE = 0.9
DECISION_ARMS = ("standard mixed precision", "standard bf16", "sonar", "sonar 8-bit")


def smallest_gpu(peak_bytes: int) -> str:
    """The smallest of :data:`GPU_SIZES_GB` whose :data:`USABLE` share holds ``peak_bytes``, or "none"."""
    return next((f"{size} GB" for size in GPU_SIZES_GB if peak_bytes <= USABLE * size * 1e9), "none")


def decision_table(rows: list[dict]) -> str:
    """Per preset and layout (checkpointing on), the peak per GPU of :data:`DECISION_ARMS` and the smallest
    GPU each fits (:func:`smallest_gpu`), as markdown; a cell the trace lacks shows the memory model's
    prediction, marked."""
    lines = [
        "| model | GPUs | " + " | ".join(DECISION_ARMS) + " |",
        "|---|---|" + "---|" * len(DECISION_ARMS),
    ]
    for preset in PRESETS:
        for layout, world in _layouts(rows, preset):
            cells = []
            for arm in DECISION_ARMS:
                row = next((r for r in rows if (r["preset"], r["layout"], r["world_size"], r["arm"])
                            == (preset, layout, world, arm) and r["checkpointing"] and "error" not in r), None)  # fmt: skip
                if row is not None:
                    cells.append(f"{row['peak_bytes'] / 2**30:.1f} GiB, {smallest_gpu(row['peak_bytes'])}")
                    continue
                if layout == "ep fsdp2" and arm not in EP_ARMS:  # not an arm of this layout
                    cells.append("")
                    continue
                model = model_peak(preset, arm, None, True, world, layout, _loss_chunk(rows))
                cells.append(
                    "" if model is None else f"{model / 2**30:.1f} GiB, {smallest_gpu(model)} (model)"
                )
            lines.append(f"| {preset} | {_layout_name(layout, world)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _loss_chunk(rows: list[dict]) -> int | None:
    """The rows' ``loss_chunk_tokens`` (one run traces one loss), or None."""
    return next((r["loss_chunk_tokens"] for r in rows if r.get("loss_chunk_tokens")), None)


def _layouts(rows: list[dict], preset: str) -> list[tuple[str, int]]:
    """The (layout, world size) pairs of ``preset``'s rows, in :data:`LAYOUTS` order, then by size."""
    pairs = {(r.get("layout", "1 gpu" if r["world_size"] == 1 else "fsdp2"), r["world_size"])
             for r in rows if r["preset"] == preset}  # fmt: skip
    return sorted(pairs, key=lambda pair: (pair[1] > 1, LAYOUTS.index(pair[0]), pair[1]))


def _layout_name(layout: str, world: int) -> str:
    return {"1 gpu": "1", "fsdp2": f"{world}, FSDP2", "ep fsdp2": f"{world}, EP x FSDP2-dense"}[layout]


def ep_savings(rows: list[dict]) -> list[dict]:
    """Per expert-parallel (preset, ranks, checkpointing): standard bf16's and sonar's traced peaks per rank,
    the bytes of the rank's expert gradients (its local experts' gate_up_proj and down_proj in bf16, which
    sonar never allocates), those standard holds at its peak (the memory model's account of that moment,
    which agrees with the trace: :func:`model_expert_gradients`), and the share of the latter that sonar's
    peak saves: (standard - sonar) / expert gradients at standard's peak (None where it holds none)."""
    out = []
    for r in rows:
        if r.get("layout") != "ep fsdp2" or r["arm"] != "standard bf16" or "error" in r:
            continue
        key = (r["preset"], r["world_size"], r["checkpointing"], r["layers"])
        sonar = next((q for q in rows if q.get("layout") == "ep fsdp2" and q["arm"] == "sonar" and "error" not in q
                      and (q["preset"], q["world_size"], q["checkpointing"], q["layers"]) == key), None)  # fmt: skip
        if sonar is None:
            continue
        held = r["model_expert_gradients_at_peak"]
        out.append({"preset": key[0], "ranks": key[1], "checkpointing": key[2], "layers": key[3],
                    "standard_bytes": r["peak_bytes"], "sonar_bytes": sonar["peak_bytes"],
                    "expert_gradient_bytes": r["expert_gradient_bytes"], "standard_expert_gradients_at_peak": held,
                    "sonar_expert_gradients_at_peak": sonar["model_expert_gradients_at_peak"],
                    "saved_share": (r["peak_bytes"] - sonar["peak_bytes"]) / held if held else None})  # fmt: skip
    return out


def ep_table(rows: list[dict]) -> str:
    """:func:`ep_savings` as markdown."""
    lines = ["| preset | ranks | checkpointing | standard bf16 GiB | sonar GiB | expert gradients per rank GiB | "
             "held at standard's peak GiB | at sonar's | sonar's peak saves, of those standard holds |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for e in ep_savings(rows):
        share = "" if e["saved_share"] is None else f"{e['saved_share']:.1%}"
        lines.append(
            f"| {e['preset']} | {e['ranks']} | {'on' if e['checkpointing'] else 'off'} | "
            f"{e['standard_bytes'] / 2**30:.2f} | {e['sonar_bytes'] / 2**30:.2f} | "
            f"{e['expert_gradient_bytes'] / 2**30:.2f} | {e['standard_expert_gradients_at_peak'] / 2**30:.2f} | "
            f"{e['sonar_expert_gradients_at_peak'] / 2**30:.2f} | {share} |"
        )
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    """The report as markdown: per preset, layout and checkpointing, each arm's peak per rank and its ratio
    to standard bf16."""
    lines = []
    for preset in dict.fromkeys(r["preset"] for r in rows):
        for layout_key, world in _layouts(rows, preset):
            for ck in (True, False):
                part = [r for r in rows if r["preset"] == preset and r["world_size"] == world
                        and r.get("layout", layout_key) == layout_key and r["checkpointing"] == ck
                        and "error" not in r]  # fmt: skip
                if not part:
                    continue
                layout = {"1 gpu": "one GPU", "fsdp2": f"FSDP2 over {world} ranks, per rank",
                          "ep fsdp2": f"EP over {world} ranks with the dense layers on FSDP2, balanced routing, "
                          "per rank"}[layout_key]  # fmt: skip
                base = next((r["peak_bytes"] for r in part if r["arm"] == "standard bf16"), None)
                chunked = part[0].get("loss_chunk_tokens")
                loss = f", with the chunked loss ({chunked} tokens a chunk)" if chunked else ""
                lines += [f"**{preset}**, {part[0]['layers']} layers, {layout}, activation checkpointing "
                          f"{'on' if ck else 'off'}{loss} ({part[0]['parameters'] / 1e9:.2f} B parameters, {part[0]['mode']})",
                          "", "| arm | precision | peak GiB | vs standard bf16 | memory model GiB |",
                          "|---|---|---|---|---|"]  # fmt: skip
                for r in part:
                    ratio = f"{r['peak_bytes'] / base - 1:+.1%}" if base else ""
                    model = "" if r["model_peak_bytes"] is None else f"{r['model_peak_bytes'] / 2**30:.2f}"
                    lines.append(
                        f"| {r['arm']} | {r['precision']} | {r['peak_bytes'] / 2**30:.2f} | {ratio} | {model} |"
                    )
                lines.append("")
    return "\n".join(lines)


# What a real trace holds besides its peak: the interpreter, torch, transformers and the model's build.
REAL_HEADROOM = 3 * 2**30


def check(
    presets, arms, depths, cks, jobs: int, layouts=(("1 gpu", 1),), loss_chunk_tokens: int | None = None
) -> tuple[list[dict], list[dict]]:
    """The fake trace against real allocations (``--check``): each row at the reduced ``depths`` in each of
    ``layouts`` ((layout, ranks) pairs: one rank, or one rank of a fake process group, whose collectives
    allocate their outputs and fill nothing), fake (``jobs`` processes), then real, one fresh process at a
    time, where the fake peak and :data:`REAL_HEADROOM` fit the memory available when it starts. Returns
    (rows of both modes, the real rows left out, each with its reason)."""
    import torch

    from sonar_kernels.train.memory import available_memory

    tasks = [(p, a, d, ck, True, w, None, layout, loss_chunk_tokens) for d in depths for p in presets for layout, w in layouts
             for ck in cks for a in arms if _traced(a, layout)]  # fmt: skip
    fakes = run(tasks, jobs)
    reals, skipped = [], []
    for row in fakes:
        if "error" in row:
            continue
        task = (row["preset"], row["arm"], row["layers"], row["checkpointing"], False, row["world_size"], None,
                row["layout"], loss_chunk_tokens)  # fmt: skip
        available = available_memory(torch.device("cpu"))["host"] or 0
        if row["peak_bytes"] + REAL_HEADROOM > available:
            need = (row["peak_bytes"] + REAL_HEADROOM) / 2**30
            skipped.append(
                {"task": task, "reason": f"needs {need:.1f} GiB, {available / 2**30:.1f} GiB available"}
            )
            print(f"real {task[:4]} left out: {skipped[-1]['reason']}", flush=True)
            continue
        reals += run([task], 1)
    return fakes + reals, skipped


def check_table(rows: list[dict], skipped: list[dict]) -> str:
    """Fake against real, row by row, as markdown."""
    by = {
        (r["preset"], r.get("layout", "1 gpu"), r["world_size"], r["arm"], r["layers"], r["checkpointing"],
         r["mode"]): r
        for r in rows
        if "error" not in r
    }  # fmt: skip
    lines = [
        "| preset | layout | layers | checkpointing | arm | fake GiB | real GiB | fake vs real |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (preset, layout, world, arm, layers, ck, mode), fake in by.items():
        if mode != "fake":
            continue
        real = by.get((preset, layout, world, arm, layers, ck, "real"))
        cells = (
            ("not run (memory)", "")
            if real is None
            else (f"{real['peak_bytes'] / 2**30:.3f}", f"{fake['peak_bytes'] / real['peak_bytes'] - 1:+.2%}")
        )
        lines.append(
            f"| {preset} | {_layout_name(layout, world)} | {layers} | {'on' if ck else 'off'} | {arm} | "
            f"{fake['peak_bytes'] / 2**30:.3f} | "
            f"{cells[0]} | {cells[1]} |"
        )
    lines += [
        "",
        *(f"- real {e['task'][0]} {e['task'][1]}, {e['task'][2]} layers: {e['reason']}" for e in skipped),
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", choices=PRESETS, default=list(PRESETS))
    parser.add_argument("--arms", nargs="+", choices=tuple(ARMS), default=list(ARMS))
    parser.add_argument("--layers", type=int, nargs="+", default=[None],
                        help="decoder layers, one or more depths (default: the preset's, full depth)")  # fmt: skip
    parser.add_argument("--checkpointing", choices=("on", "off", "both"), default="both")
    parser.add_argument(
        "--world-sizes",
        type=int,
        nargs="+",
        default=[1, 4, 8],
        help="ranks: 1 (one GPU) and each --layouts over each larger size (a fake process group)",
    )
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS[1:], default=list(LAYOUTS[1:]),
                        help="the layouts above one rank (ep fsdp2: the arms of EP_ARMS)")  # fmt: skip
    parser.add_argument(
        "--real", action="store_true", help="real CPU tensors instead of fake ones (reduced depth)"
    )
    parser.add_argument("--check", action="store_true",
                        help="fake and real traces of every row at --layers, compared (check())")  # fmt: skip
    parser.add_argument("--loss-chunk-tokens", type=int, metavar="N",
                        help="every row's loss over chunks of N tokens (sonar-train's --loss-chunk-tokens)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="traces at once (processes)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "memory-real" / "report.json")
    args = parser.parse_args(argv)
    cks = {"on": (True,), "off": (False,), "both": (True, False)}[args.checkpointing]
    # The largest preset first, so that the processes finish together.
    presets = sorted(args.presets, key=PRESETS.index, reverse=True)
    start = time.perf_counter()
    skipped = None
    if args.check:
        if None in args.layers:
            parser.error("--check needs --layers (reduced depths whose real tensors fit this machine)")
        layouts = [("1 gpu", 1)] * (1 in args.world_sizes)
        layouts += [(layout, w) for w in args.world_sizes if w > 1 for layout in args.layouts]
        rows, skipped = check(
            presets, args.arms, args.layers, cks, args.jobs, layouts, args.loss_chunk_tokens
        )
        text = check_table(rows, skipped)
    else:
        tasks = [(p, a, d, ck, not args.real, w, None, layout, args.loss_chunk_tokens) for d in args.layers for p in presets
                 for w in args.world_sizes for layout in (["1 gpu"] if w == 1 else args.layouts)
                 for ck in cks for a in args.arms if _traced(a, layout)]  # fmt: skip
        rows = run(tasks, args.jobs)
        text = decision_table(rows) + "\n\n" + table(rows)
        if any(r.get("layout") == "ep fsdp2" for r in rows):
            text += "\n\n" + ep_table(rows)
    from check_backward import _commit  # git's HEAD, or "unknown"

    report = {"rows": rows, "commit": _commit(), "versions": _versions(), "date": datetime.date.today().isoformat(),
              "seconds": time.perf_counter() - start}  # fmt: skip
    if skipped is not None:
        report["real_left_out"] = skipped
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text(text)
    print(text)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')} in {report['seconds']:.0f} s")
    return 1 if any("error" in r for r in rows) else 0


def _traced(arm: str, layout: str) -> bool:
    """Whether ``arm`` is traced in ``layout`` (:data:`FSDP2_UNTRACED`, :data:`ONE_GPU_ONLY`, :data:`EP_ARMS`)."""
    if layout == "ep fsdp2":
        return arm in EP_ARMS
    return layout == "1 gpu" or arm not in FSDP2_UNTRACED | ONE_GPU_ONLY


def _versions() -> dict:
    import importlib.metadata as metadata

    return {name: metadata.version(name) for name in ("torch", "triton", "transformers")}


if __name__ == "__main__":
    sys.exit(main())
