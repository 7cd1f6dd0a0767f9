"""sonar-train's arms: the model, each arm's optimizer and schedule, one training step, the timed run."""

from __future__ import annotations

import contextlib
import copy
import math
import sys
import time
import warnings
from dataclasses import dataclass

import torch

from sonar_kernels.ops.triton_backend.wgrad_update import split_scratch
from sonar_kernels.optim.param_groups import torch_adamw_flags
from sonar_kernels.train import distributed
from sonar_kernels.train.clipping import (
    CLIPPING_CONTROLS,
    CLIPPING_MODE,
    LaggedControl,
    SpikeControl,
    clipping_telemetry,
)
from sonar_kernels.train.data import ByteData, Preset
from sonar_kernels.train.in_backward import EXPERT_PARAMS, AllInBackward, TorchExpertsInBackward
from sonar_kernels.train.loss import chunked_causal_lm_loss

# The arms' names (ARMS by default; OTHER_ARMS on request; MASTER_ARMS with --dtype bfloat16, docs/design.md
# "bf16 master weights": SonarAdamW with a remainder or stochastic rounding for the experts, mixed-precision
# AdamW as their reference, the remainder's bitwise control; the clipping arms: train/clipping.py) live with
# the command line that offers them (sonar_kernels_cli.options: --help answers without torch).

# The arms that train with SonarAdamW: exact moments, 8-bit moments (docs/design.md, "8-bit moments"), bf16
# master weights.
# "paper": the Sonar-MoE paper's method, SonarAdamW's split path (fused_epilogue=False) with the whole
# gradient (its backward under split_scratch(fraction=1), Arm.split_fraction): each expert tensor's gradient
# written as a tensor and applied in the backward, then released (the same bits as sonar).
SONAR_ARMS = ("sonar", "paper", "sonar-8bit", "sonar-remainder", "sonar-stochastic", "sonar-remainder-8bit",
              "sonar-stochastic-8bit", "sonar-spike", "sonar-lagged")  # fmt: skip
# Each sonar arm's control, run on the first seed only: its training with materialized gradients and a
# separate step that must give the same bits (dense clipping, the experts' update as the sonar arm's).
CONTROLS = {"sonar": "standard-dense-clip", "sonar-remainder": "remainder-control", **CLIPPING_CONTROLS}


LR_FLOOR = 0.1  # the cosine schedule ends at this fraction of --lr


def build_model(preset: Preset, layers: int | None, seed: int, dtype: torch.dtype, device: torch.device):
    """The preset's transformers model with experts_implementation "sonar", randomly initialised."""
    import transformers

    common = {
        "vocab_size": preset.vocab_size,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": layers or preset.num_layers,
        "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_kv_heads,
        "num_experts_per_tok": preset.top_k,
        "max_position_embeddings": 4096,
        "output_router_logits": True,  # the load-balancing loss is part of the training loss
        "use_cache": False,  # training only (and transformers warns when checkpointing meets the cache)
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "tie_word_embeddings": False,
        **preset.extra,
    }
    if preset.family == "olmoe":
        config = transformers.OlmoeConfig(num_experts=preset.num_experts, **common)
        cls = transformers.OlmoeForCausalLM
    elif preset.family == "qwen3_moe":  # every layer sparse; intermediate_size: the experts'
        common["moe_intermediate_size"] = common.pop("intermediate_size")
        config = transformers.Qwen3MoeConfig(num_experts=preset.num_experts, **common)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.GraniteMoeConfig(num_local_experts=preset.num_experts, **common)
        cls = transformers.GraniteMoeForCausalLM
    config._experts_implementation = "sonar"
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    # Initialised where it trains, in its dtype (a 7B model on a GPU, without an fp32 copy first).
    with warnings.catch_warnings(), torch.device(device):
        warnings.simplefilter("ignore")
        torch.set_default_dtype(dtype)
        try:
            model = cls(config)
        finally:
            torch.set_default_dtype(default_dtype)
    return model.to(dtype=dtype)


def enable_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing of every decoder layer (transformers' own)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def dense_parameters(model) -> list[torch.Tensor]:
    return [p for name, p in model.named_parameters() if not name.endswith(EXPERT_PARAMS)]


class Torchao8bit:
    """The anchor of 8-bit moments (docs/design.md, "Against torchao's AdamW8bit"): standard training
    (materialized gradients, clipped over all parameters, then a separate step) whose expert tensors are
    stepped by torchao's ``AdamW8bit`` (blocks of 256, dynamic-tree maps) and the other parameters by
    torch.optim.AdamW with ``flags``."""

    def __init__(self, model, hyper: dict, flags: dict):
        from torchao.optim import AdamW8bit

        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.experts = AdamW8bit([p for n, p in named if n.endswith(EXPERT_PARAMS)], **hyper)
        self.dense = torch.optim.AdamW(
            [p for n, p in named if not n.endswith(EXPERT_PARAMS)], **hyper, **flags
        )

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.experts, self.dense]

    def step(self) -> None:
        self.dense.step()
        self.experts.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none)


class Fp32Masters:
    """AdamW with fp32 master weights over a bf16 model: each chosen parameter's master (an fp32 copy)
    updated by torch.optim.AdamW with ``flags`` (fp32 moments) from its bf16 gradient as fp32, the model's
    bf16 tensor rewritten from it after each step; the other trainable parameters updated as they are by
    the same optimizer.

    ``experts_only=False``: standard mixed-precision AdamW ("mixed-precision", the reference of bf16 master
    weights: every parameter has a master, the gradients are clipped over all masters at
    ``max_grad_norm``, the bf16 copy is torch's cast, ties to even). ``experts_only=True``: the control of
    SonarAdamW(master_weights="remainder") ("remainder-control"): masters for the expert tensors only,
    rounded with the remainder's rule (``rules.master_weights.split``, ties away from zero), nothing clipped
    here (the caller clips the dense gradients, as SonarAdamW does); its masters must equal the sonar
    arm's reconstructed ones bit for bit."""

    def __init__(self, model, hyper: dict, flags: dict, experts_only: bool, max_grad_norm: float | None):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.pairs = [
            (p, torch.nn.Parameter(p.detach().float()))
            for n, p in named
            if not experts_only or n.endswith(EXPERT_PARAMS)
        ]
        # A module, so that MemTracker counts the masters as parameters (sonar_kernels/train/memory.py).
        self.masters = torch.nn.ParameterList([m for _, m in self.pairs])
        mastered = {id(p) for p, _ in self.pairs}
        rest = [p for _, p in named if id(p) not in mastered]
        self.optimizer = torch.optim.AdamW([*self.masters, *rest], **hyper, **flags)
        self.experts_only = experts_only
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm = None

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]

    def master_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s fp32 master, or None (a parameter trained as it is)."""
        return next((m for q, m in self.pairs if q is p), None)

    def step(self) -> None:
        from sonar_kernels.rules.master_weights import split

        for p, master in self.pairs:  # one fp32 gradient at a time replaces its bf16 one
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        if self.max_grad_norm is not None:
            self.last_grad_norm = torch.nn.utils.clip_grad_norm_(list(self.masters), self.max_grad_norm)
        self.optimizer.step()
        with torch.no_grad():
            for p, master in self.pairs:
                p.copy_(split(master.detach())[0] if self.experts_only else master.detach())

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)


def master_values(arm) -> list[torch.Tensor]:
    """The arm's parameters in the model's order as it trains them, CPU copies: a tensor with an fp32
    master (Fp32Masters) or a remainder (SonarAdamW with master_weights="remainder") as that master."""
    from sonar_kernels.rules.master_weights import merge

    values = []
    for p in arm.model.parameters():
        value = p.detach()
        if isinstance(arm.optimizer, Fp32Masters):
            master = arm.optimizer.master_of(p)
            value = value if master is None else master.detach()
        else:
            state = arm.optimizer.state.get(p, {})
            if "remainder" in state:
                value = merge(value, state["remainder"])
        values.append(value.to("cpu", copy=True))
    return values


@dataclass
class Arm:
    name: str
    model: object
    optimizer: object  # a torch.optim.Optimizer, or AllInBackward
    schedulers: list
    clip_params: list[torch.Tensor] | None  # None: SonarAdamW clips in step(), or nothing is clipped
    wrapped: object = None  # the model as trained: DistributedDataParallel on several ranks
    ep_experts: list[torch.Tensor] | None = None  # this rank's expert tensors under --ep (else None)
    # sonar: the expert updates counted from the tensors' AdamW step counts, in the backward and in
    # step() (device tensors; None when not counted, e.g. in the memory pass).
    updates: dict | None = None
    # The expert-clipping arms' telemetry, one device tensor per step (None when not recorded, e.g. in
    # the memory pass): the elements the spike rule replaced (int64), or the lagged coefficient that the
    # next step's expert gradients are multiplied by (fp32).
    clipping: list | None = None
    # The split path's scratch over this arm's backward (``sonar_kernels.ops.triton_backend.wgrad_update.split_scratch``'s
    # fraction of an expert tensor's gradient; set around the backward only): 1 for the paper arm, the
    # whole gradient as the paper's method writes it; None: the library's bound (a chunk of experts).
    split_fraction: int | None = None
    # The causal-LM loss over chunks of this many tokens (``loss.chunked_causal_lm_loss``,
    # ``--loss-chunk-tokens``); None: transformers' ``.loss``.
    loss_chunk_tokens: int | None = None

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return getattr(self.optimizer, "optimizers", [self.optimizer])


def build_arm(name: str, initial, args, steps: int, count_updates: bool = False) -> Arm:
    """Arm ``name`` on a copy of ``initial`` (moved to ``args.device_obj``), with its optimizer and LR
    schedule over ``steps`` steps; ``count_updates`` (the training runs): count the sonar arms' expert
    updates and record the expert-clipping arms' telemetry (see :func:`train_step`)."""
    import sonar_kernels

    model = copy.deepcopy(initial).to(args.device_obj)
    ep_experts = None
    if getattr(args, "ep", 1) > 1:  # this rank's experts of every layer, reached by all-to-all
        from sonar_kernels.integrations import transformers as hf

        hf.shard_experts(model, distributed.group())
        ep_experts = [p for n, p in model.named_parameters() if n.endswith(EXPERT_PARAMS)]
    if args.checkpointing:
        enable_checkpointing(model)
    model.train()
    hyper = {"lr": args.lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    # The same torch AdamW path in every arm: the flags given, else torch's fused AdamW wherever torch has it
    # for the model's device and dtype (the one rule of SonarAdamW and ExpertAdamW; cli.py sets --fused so).
    chosen = torch_adamw_flags({"foreach": args.foreach, "fused": args.fused}, list(model.parameters()))
    flags = dict(zip(("foreach", "fused"), chosen, strict=True))
    clip = None
    if name in SONAR_ARMS:
        master = next((m for m in ("remainder", "stochastic") if m in name), None)
        clipping = {}  # only for the clipping arms: the other arms build as before expert_clipping existed
        if name in CLIPPING_MODE:
            clipping["expert_clipping"] = CLIPPING_MODE[name]
            if name == "sonar-spike":
                clipping["spike_threshold"] = args.spike_threshold
        optimizer = sonar_kernels.SonarAdamW(
            model, **hyper, **flags, max_grad_norm=args.max_grad_norm,
            data_parallel_group=None if ep_experts is not None else distributed.group(),
            moments_dtype="8bit" if name.endswith("8bit") else None, master_weights=master,
            fused_epilogue=name != "paper", **clipping,
        )  # fmt: skip
    elif name in ("spike-control", "lagged-control"):
        params = [p for p in model.parameters() if p.requires_grad]
        experts = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith(EXPERT_PARAMS)]
        if name == "spike-control":
            optimizer = SpikeControl(params, experts, hyper, flags, args.spike_threshold)
            clip = dense_parameters(model)
        else:  # clips in its step(): the dense gradients by the norm over all of them
            optimizer = LaggedControl(params, experts, hyper, flags, args.max_grad_norm)
    elif name in ("mixed-precision", "remainder-control"):
        control = name == "remainder-control"
        optimizer = Fp32Masters(model, hyper, flags, experts_only=control,
                                max_grad_norm=None if control else args.max_grad_norm)  # fmt: skip
        clip = dense_parameters(model) if control else None
    elif name == "all-in-backward":
        optimizer = AllInBackward(model, hyper, flags)
    elif name in ("paper-inbwd", "per-expert-inbwd"):  # the paper's method with torch's AdamW, dense clipping
        optimizer = TorchExpertsInBackward(model, hyper, flags, per_expert=name == "per-expert-inbwd")
        clip = dense_parameters(model)
    elif name == "torchao-8bit":
        optimizer, clip = Torchao8bit(model, hyper, flags), list(model.parameters())
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **hyper, **flags)
        clip = list(model.parameters()) if name == "standard" else dense_parameters(model)
        if ep_experts is not None:  # each rank's own experts: never in DDP (SonarAdamW does this itself)
            from sonar_kernels.optim.distributed import exclude_from_ddp

            exclude_from_ddp(model, ep_experts)
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, steps // 10)

    def schedule(step):  # linear warm-up, then cosine decay to LR_FLOOR
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress))

    arm = Arm(name, model, optimizer, [], clip, distributed.wrap(model), ep_experts)
    if name == "paper":
        arm.split_fraction = 1
    arm.loss_chunk_tokens = getattr(args, "loss_chunk_tokens", None)
    if name in SONAR_ARMS and count_updates:
        arm.updates = {"backward": 0, "step": 0}
    if name in CLIPPING_MODE and count_updates:
        arm.clipping = []
    arm.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in arm.optimizers]
    return arm


def train_step(
    arm: Arm, tokens: torch.Tensor, max_grad_norm: float, spike: float | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step; returns (loss, norm used for clipping, None when nothing is clipped) as device
    tensors (no host sync). ``spike``: the loss is multiplied by it before the backward (the injected
    spike, ``--inject-spike``), and the returned loss is the multiplied one. With ``arm.updates``, the
    expert tensors' AdamW step counts are read (on the device) before and after the backward and after
    ``step()``: the increments are the updates that happened in each. With ``arm.clipping``, the step's
    expert-clipping telemetry is appended (``clipping.clipping_telemetry``). With ``arm.loss_chunk_tokens``
    the loss is ``loss.chunked_causal_lm_loss``'s."""
    if arm.loss_chunk_tokens is None:
        loss = (arm.wrapped or arm.model)(input_ids=tokens, labels=tokens).loss
    else:
        loss = chunked_causal_lm_loss(arm.wrapped or arm.model, tokens, tokens, arm.loss_chunk_tokens)
    if spike is not None:
        loss = loss * spike
    before = _expert_step_count(arm) if arm.updates is not None else None
    # The expert updates run in the backward: the split path's scratch bound set for it (the paper arm's
    # whole gradient), process-wide, and restored before any other arm runs.
    with contextlib.nullcontext() if arm.split_fraction is None else split_scratch(arm.split_fraction):
        loss.backward()
    after_backward = _expert_step_count(arm) if arm.updates is not None else None
    norm = None
    if arm.clip_params is not None:
        if arm.ep_experts is not None and arm.name == "standard":
            norm = _ep_clip(arm, max_grad_norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(arm.clip_params, max_grad_norm)
    arm.optimizer.step()
    if arm.updates is not None:
        arm.updates["backward"] = arm.updates["backward"] + (after_backward - before)
        arm.updates["step"] = arm.updates["step"] + (_expert_step_count(arm) - after_backward)
    if arm.clipping is not None:
        arm.clipping.append(clipping_telemetry(arm.name, arm.optimizer))
    if arm.name in ("sonar-lagged", "lagged-control"):  # the global norm: the dense gradients' clipping
        norm = arm.optimizer.last_grad_norm
    elif arm.name in SONAR_ARMS:
        norm = arm.optimizer.last_dense_grad_norm
    elif arm.name == "mixed-precision":  # clipped over the fp32 masters' gradients, in its step
        norm = arm.optimizer.last_grad_norm
    for scheduler in arm.schedulers:
        scheduler.step()
    arm.optimizer.zero_grad(set_to_none=True)
    return loss.detach(), None if norm is None else norm.detach()


def _ep_clip(arm: Arm, max_grad_norm: float) -> torch.Tensor:
    """Global-norm clipping under expert parallelism (the standard arm): each rank holds other experts, so
    their squared norms are summed over the ranks; the dense gradients are the same on every rank after DDP,
    or sharded by FSDP2 (the layout ``sonar_kernels.nn.fully_shard_dense`` builds; bench/memory_real.py),
    whose norm is a DTensor made whole by its all-reduce, and whose gradients are scaled by the norm as a
    replicated DTensor (torch refuses a DTensor and a plain tensor in one operation). Returns the norm."""
    from torch.distributed.tensor import DTensor, Replicate

    dense_params = [p for p in arm.clip_params if not _among(p, arm.ep_experts)]
    experts = [p.grad for p in arm.ep_experts if p.grad is not None]
    expert_sq = distributed.all_reduce_sum(torch.nn.utils.get_total_norm(experts).square())
    dense_norm = torch.nn.utils.get_total_norm([p.grad for p in dense_params if p.grad is not None])
    mesh = dense_norm.device_mesh if isinstance(dense_norm, DTensor) else None
    if mesh is not None:
        dense_norm = dense_norm.full_tensor()
    norm = torch.sqrt(dense_norm.square() + expert_sq)
    torch.nn.utils.clip_grads_with_norm_(arm.ep_experts, max_grad_norm, norm)
    dense_by = norm if mesh is None else DTensor.from_local(norm, mesh, [Replicate()] * mesh.ndim)
    torch.nn.utils.clip_grads_with_norm_(dense_params, max_grad_norm, dense_by)
    return norm


def _expert_step_count(arm: Arm) -> torch.Tensor:
    """The sum of the AdamW step counts of the sonar optimizer's expert tensors (a device tensor)."""
    state = arm.optimizer.state
    return torch.stack([state[p]["step"] for p in arm.optimizer.expert_tensors]).sum()


def _among(p: torch.Tensor, tensors) -> bool:
    return any(p is q for q in tensors)


@torch.no_grad()
def heldout_loss(
    model, batches: list[torch.Tensor], progress=None, loss_chunk_tokens: int | None = None
) -> float:
    """Mean next-byte cross-entropy (nats) over the held-out batches, without the load-balancing loss.
    ``progress``: tqdm keyword arguments for a progress bar (None: none). ``loss_chunk_tokens``: the
    training's chunked loss (``--loss-chunk-tokens``, train/loss.py), so that the evaluation holds one
    chunk's logits too (None: transformers' ``.loss``)."""
    from tqdm import tqdm

    model.eval()
    total = 0.0
    # A context: the bar is closed (its line cleared) when Ctrl-C ends the run in the middle.
    with tqdm(
        total=len(batches), unit="batch", file=sys.stderr, disable=progress is None, **(progress or {})
    ) as bar:
        for tokens in batches:
            if loss_chunk_tokens is None:
                loss = model(input_ids=tokens, labels=tokens, output_router_logits=False).loss
            else:
                loss = chunked_causal_lm_loss(
                    model, tokens, tokens, loss_chunk_tokens, output_router_logits=False
                )
            total += float(loss)
            bar.update()
    model.train()
    return total / len(batches)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_arm(
    arm: Arm, data: ByteData, steps: int, args, device: torch.device, heldout, label: str = ""
) -> dict:
    """Train ``arm`` for ``steps`` steps of ``data``, then evaluate it on ``heldout``. Every step is timed
    (synchronized with the device around it); the caller leaves out the warm-up steps. ``args.inject_spike``
    (STEP, SCALE), or None: the loss of step STEP (counted from 1) multiplied by SCALE."""
    from tqdm import tqdm

    label = label or arm.name
    losses, norms, times = [], [], []
    spike_step, spike = args.inject_spike or (None, None)
    # The bar leaves no line behind (the caller prints one per finished run) and is closed on Ctrl-C.
    with tqdm(total=steps, desc=label, unit="step", file=sys.stderr, disable=args.quiet, leave=False) as bar:
        for step in range(steps):
            tokens = data.batch(distributed.batch_index(step)).to(device)
            injected = {"spike": spike} if step + 1 == spike_step else {}  # --inject-spike counts from 1
            sync(device)
            start = time.perf_counter()
            loss, norm = train_step(arm, tokens, args.max_grad_norm, **injected)
            sync(device)
            times.append(time.perf_counter() - start)
            losses.append(loss)
            norms.append(norm)
            bar.update()
    losses = [float(x) for x in losses]
    norms = None if norms[0] is None else [float(x) for x in norms]
    progress = None if args.quiet else {"desc": f"{label} held-out", "leave": False}
    return {
        "train_losses": losses,
        "heldout_loss": heldout_loss(arm.model, heldout, progress, arm.loss_chunk_tokens),
        # clip_grad_norm_ scales by max / (norm + 1e-6): the gradients change when that is below 1.
        "clip_fraction": 0.0
        if norms is None
        else sum(n + 1e-6 > args.max_grad_norm for n in norms) / len(norms),
        "grad_norms": norms,
        "step_times_s": times,
        # The expert-clipping arms: per step, elements replaced (spike) or the next step's coefficient
        # (lagged); None for the other arms.
        "clipping": None if arm.clipping is None else [x.item() for x in arm.clipping],
    }


def time_interleaved(arms: list[Arm], data: ByteData, warmup: int, rounds: int, args, device) -> dict:
    """Step times of ``arms`` measured side by side: ``warmup`` + ``rounds`` rounds, each one training step
    of every arm on the same batch, the arms' order rotated from round to round, so that a machine that
    slows down or speeds up for a while (other tenants of a virtual machine, clocks) weighs on every arm
    alike. Returns {arm name: its step times in seconds, the warm-up rounds first}."""
    times = {arm.name: [] for arm in arms}
    for step in range(warmup + rounds):
        tokens = data.batch(step).to(device)
        shift = step % len(arms)
        for arm in arms[shift:] + arms[:shift]:
            sync(device)
            start = time.perf_counter()
            train_step(arm, tokens, args.max_grad_norm)
            sync(device)
            times[arm.name].append(time.perf_counter() - start)
    return times
