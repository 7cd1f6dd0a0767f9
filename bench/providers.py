"""One training step of one expert-MLP layer (forward, backward, AdamW update), by each provider of the
benchmark table, on the same tensors.

Providers (issue 30: what a user would compare against, side by side in one run):

- ``sonar``: what users run on this device: ``sonar_kernels.moe_mlp`` with ``sonar_kernels.ExpertAdamW``,
  the update applied inside the backward and no gradient kept. On CUDA the Triton backend, AdamW fused
  into the wgrad epilogue; on the CPU the torch backend, each expert tensor updated by the library's
  in-backward torch AdamW as soon as its gradient exists.
- ``sonar-unfused``: the same expert MLP writing dW to ``.grad``, then torch.optim.AdamW (fused where torch
  has it). Its forward and forward+backward are those of sonar and of the paper's providers.
- ``paper-inbwd``: the paper's method: the same expert MLP writing dW, and torch's AdamW (fused where torch
  has it) applied to the batched tensor from its post-accumulate-grad hook, the gradient released right
  after (one layer of gradients alive).
- ``per-expert-inbwd``: as paper-inbwd, but one AdamW call per expert slice (the paper's ablation).
- ``standard-fused``: the baseline: transformers' own experts module ("grouped_mm" where it runs, else
  "eager"), ``clip_grad_norm_`` and torch.optim.AdamW(fused=True) where torch has a fused AdamW for the
  device and dtype (the CPU and CUDA).
- ``standard``: the same with torch's default AdamW flags (foreach=None, fused=None: single-tensor on the
  CPU, foreach on CUDA).

Every ratio of the tables is provider / :data:`BASELINE` (standard-fused): below 1 is better.

Each provider is built by :func:`build` and returns a :class:`Step`: ``run()`` does one step, ``weights()``
returns the updated (gate_up_proj, down_proj), ``phase(name)`` the callable that times one of
:data:`PHASES`; ``experts`` and ``update`` say what computed the experts and what applied AdamW.

Phases: ``forward`` (the training forward, autograd graph built), ``forward+backward`` (plain gradients
written, no update) and ``step`` (forward, backward and the AdamW update). The first two are measured for
``sonar-unfused`` and ``standard-fused`` only: sonar and the paper's providers run the same forward and
backward as sonar-unfused, standard's are standard-fused's, and they differ in the update alone
(:func:`phase_providers`).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.optim.adamw import adamw as torch_adamw

import sonar_kernels

PROVIDERS = ("sonar", "sonar-unfused", "paper-inbwd", "per-expert-inbwd", "standard-fused", "standard")
# sonar with the state kinds beyond the paper (docs/design.md): 8-bit moments, and bf16 weights with the
# 16-bit remainder (their fp32 master) or rounded stochastically. Built by :func:`build` like the others but
# not in PROVIDERS: they do not take the same steps (8-bit moments, other roundings), and `make bench`
# times PROVIDERS. bench/gpu_bench.py times them beside the others.
STATE_KIND_PROVIDERS = {
    "sonar-8bit": {"moments_dtype": "8bit"},
    "sonar-remainder": {"master_weights": "remainder"},
    "sonar-stochastic": {"master_weights": "stochastic"},
    # Expert clipping's spike rule in the epilogue (docs/design.md, "Expert clipping"): what the guard costs.
    "sonar-spike": {"expert_clipping": "spike"},
}
# The provider every ratio divides by.
BASELINE = "standard-fused"
PHASES = ("forward", "forward+backward", "step")
HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


class Shape(NamedTuple):
    """T tokens, H hidden, I expert intermediate, E experts, top_k (docs/design.md notation)."""

    T: int
    H: int
    I: int
    E: int
    top_k: int

    def flops(self, backward: bool = True) -> int:
        """FLOPs of one SwiGLU expert-MLP layer: forward 6·T·top_k·H·I, forward+backward 18·T·top_k·H·I."""
        return (18 if backward else 6) * self.T * self.top_k * self.H * self.I

    def phase_flops(self, phase: str) -> int:
        """The GEMM FLOPs of ``phase`` (the AdamW update's elementwise work is not counted)."""
        return self.flops(backward=phase != "forward")

    def expert_grad_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of the layer's expert gradients, those of gate_up_proj [E, 2I, H] and down_proj [E, H, I],
        in the weights' ``dtype``: what standard training holds in ``.grad`` for this layer until its
        optimizer step."""
        return 3 * self.E * self.H * self.I * torch.empty((), dtype=dtype).element_size()


def phase_providers(phase: str) -> tuple[str, ...]:
    """The providers whose ``phase`` is measured: every provider's step; the forward and the
    forward+backward of the sonar expert MLP (as sonar-unfused) and of transformers' experts (as
    standard-fused, the baseline)."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    return PROVIDERS if phase == "step" else ("sonar-unfused", BASELINE)


def fused_adamw_runs(p: torch.Tensor) -> bool:
    """Whether torch has a fused AdamW for ``p``'s device and dtype (the library's rule, the one its
    optimizers' default flags follow: ``sonar_kernels.ops.has_torch_fused_adamw``)."""
    return sonar_kernels.ops.has_torch_fused_adamw(p.device, p.dtype)


# Layer shapes: one MoE layer of each model (T tokens per step), and CPU-sized ones: sonar-train's
# tiny-olmoe layer (batch 4 x 128 tokens), a larger layer, and the interpreter's test shapes.
SHAPES = {
    "olmoe-1b-7b": Shape(4096, 2048, 1024, 64, 8),
    "granite-3.1-3b-a800m": Shape(4096, 1536, 512, 40, 8),
    "tiny-olmoe": Shape(512, 128, 256, 32, 2),
    "cpu-large": Shape(4096, 1024, 512, 32, 2),
    "cpu-small": Shape(64, 64, 32, 8, 2),
    "cpu-tiny": Shape(16, 32, 16, 4, 2),
}


@dataclass
class Inputs:
    """Random inputs of one layer (never zeros): routed tokens, upstream gradient, initial weights."""

    x: torch.Tensor
    index: torch.Tensor
    weights: torch.Tensor
    grad_out: torch.Tensor
    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor

    def backward(self, out: torch.Tensor) -> None:
        """``out``'s backward from ``grad_out``; the gradients of x and the routing weights are dropped."""
        out.backward(self.grad_out)
        self.x.grad = self.weights.grad = None


def make_inputs(shape: Shape, dtype: torch.dtype, device, routing: str = "uniform", seed: int = 0) -> Inputs:
    """``routing``: "uniform" (random scores) or "skewed" (expert e drawn with weight ~ 1 / (e + 1)).

    ``x`` and the routing ``weights`` require grad, as inside a model, so every backward computes dX and
    the routing-weight gradient too (the 18·T·top_k·H·I FLOPs count dX); :meth:`Inputs.backward` drops them
    after each step."""
    T, H, I, E, top_k = shape
    generator = torch.Generator().manual_seed(seed)
    if routing == "uniform":
        scores = torch.rand(T, E, generator=generator)
    elif routing == "skewed":
        scores = torch.rand(T, E, generator=generator) / torch.arange(1, E + 1).float()
    else:
        raise ValueError(f"routing must be 'uniform' or 'skewed', got {routing!r}")
    top, index = scores.topk(top_k, dim=1)
    weights = torch.softmax(top, dim=1)
    tensors = {
        "x": torch.randn(T, H, generator=generator),
        "index": index,
        "weights": weights,
        "grad_out": torch.randn(T, H, generator=generator) / T,
        "gate_up_proj": torch.randn(E, 2 * I, H, generator=generator) / H**0.5,
        "down_proj": torch.randn(E, H, I, generator=generator) / I**0.5,
    }
    inputs = Inputs(
        **{
            k: v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device)
            for k, v in tensors.items()
        }
    )
    inputs.x.requires_grad_(True)
    inputs.weights.requires_grad_(True)
    return inputs


class Step:
    """One provider's training step on its own copy of the weights; ``forward`` (a callable returning the
    layer's output) is given where the provider's forward and backward are timed on their own.
    ``experts`` says what computes the experts, ``update`` what applies AdamW (recorded with each row)."""

    def __init__(self, inputs: Inputs, run, params, optimizer=None, forward=None, experts: str = "",
                 update: str = ""):  # fmt: skip
        self.inputs, self._run, self.params, self.optimizer = inputs, run, params, optimizer
        self._forward = forward
        self.experts, self.update = experts, update

    def run(self) -> None:
        self._run()

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(p.detach() for p in self.params)

    def phase(self, name: str):
        """The callable that runs phase ``name`` once (see :data:`PHASES`).

        Raises:
            ValueError: an unknown phase, or forward / forward+backward of a provider that has no forward
                of its own (see :func:`phase_providers`).
        """
        if name == "step":
            return self.run
        if name not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {name!r}")
        if self._forward is None:
            raise ValueError(f"{name!r} is measured for {phase_providers(name)} only")
        if name == "forward":
            return self._forward

        def forward_backward():
            self.inputs.backward(self._forward())
            for p in self.params:
                p.grad = None

        return forward_backward


def _params(inputs: Inputs):
    return (
        torch.nn.Parameter(inputs.gate_up_proj.clone()),
        torch.nn.Parameter(inputs.down_proj.clone()),
    )


def _forward(inputs: Inputs, w1, w2, backend: str) -> torch.Tensor:
    return sonar_kernels.moe_mlp(inputs.x, inputs.index, inputs.weights, w1, w2, backend=backend)


def _forward_backward(inputs: Inputs, w1, w2, backend: str) -> None:
    inputs.backward(_forward(inputs, w1, w2, backend))


def _in_backward_hook(state: dict, per_expert: bool, fused: bool):
    """torch's AdamW (fused or single-tensor) on the accumulated gradient of the batched tensor (or of each
    expert slice), then the gradient released: the paper's optimizer-in-backward. The hook holds only the
    tensor's own state (a hook that refers back to its parameter keeps both alive for good)."""
    flags = {
        "foreach": False, "fused": fused, "capturable": False, "amsgrad": False, "maximize": False,
        "beta1": HYPER["betas"][0], "beta2": HYPER["betas"][1], "lr": HYPER["lr"],
        "weight_decay": HYPER["weight_decay"], "eps": HYPER["eps"],
    }  # fmt: skip

    def hook(p: torch.Tensor) -> None:
        with torch.no_grad():
            if per_expert:
                for e in range(p.shape[0]):
                    torch_adamw(
                        [p[e]], [p.grad[e]], [state["exp_avg"][e]], [state["exp_avg_sq"][e]], [],
                        [state["steps"][e]], **flags,
                    )  # fmt: skip
            else:
                torch_adamw(
                    [p], [p.grad], [state["exp_avg"]], [state["exp_avg_sq"]], [], [state["step"]], **flags
                )
        p.grad = None

    return hook


def _step_tensor(p: torch.Tensor, fused: bool) -> torch.Tensor:
    # torch's fused AdamW keeps the step on the parameter's device, the single-tensor one on the CPU.
    return torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu")


def build(provider: str, inputs: Inputs, backend: str = "auto") -> Step:
    """The step of ``provider`` on a copy of ``inputs``' weights.

    Args:
        backend: the moe_mlp backend of sonar, sonar-unfused and the paper's providers ("auto": Triton on
            CUDA, torch on the CPU; "triton" under the interpreter is for correctness only).
    Raises:
        ValueError: an unknown provider, or sonar-remainder / sonar-stochastic on weights that are not bf16.
    """
    if provider not in PROVIDERS and provider not in STATE_KIND_PROVIDERS:
        raise ValueError(
            f"provider must be one of {PROVIDERS + tuple(STATE_KIND_PROVIDERS)}, got {provider!r}"
        )
    w1, w2 = _params(inputs)
    if provider in ("standard-fused", "standard"):
        return _standard(inputs, w1, w2, fused=provider == "standard-fused" and fused_adamw_runs(w1))
    step = _sonar(provider, inputs, w1, w2, backend)
    resolved = backend if backend != "auto" else ("triton" if w1.is_cuda else "torch")
    step.experts = f"sonar_kernels {resolved} backend"
    return step


def _sonar(provider: str, inputs: Inputs, w1, w2, backend: str) -> Step:
    fused = fused_adamw_runs(w1)
    if provider == "sonar":
        optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER)

        def run():
            _forward_backward(inputs, w1, w2, backend)
            optimizer.step()

        return Step(inputs, run, (w1, w2), optimizer, update="sonar_kernels.ExpertAdamW in the backward")

    if provider in STATE_KIND_PROVIDERS:
        options = STATE_KIND_PROVIDERS[provider]
        if "master_weights" in options and w1.dtype != torch.bfloat16:
            raise ValueError(f"{provider} keeps bf16 weights with an fp32 master; got {w1.dtype} weights")
        optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER, **options)

        def run():
            _forward_backward(inputs, w1, w2, backend)
            optimizer.step()

        update = f"sonar_kernels.ExpertAdamW({', '.join(f'{k}={v!r}' for k, v in options.items())}) in the backward"
        return Step(inputs, run, (w1, w2), optimizer, update=update)

    if provider == "sonar-unfused":
        optimizer = torch.optim.AdamW([w1, w2], **HYPER, fused=fused)

        def run():
            _forward_backward(inputs, w1, w2, backend)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return Step(inputs, run, (w1, w2), optimizer, functools.partial(_forward, inputs, w1, w2, backend),
                    update=f"torch.optim.AdamW(fused={fused}) after the backward")  # fmt: skip

    if provider in ("paper-inbwd", "per-expert-inbwd"):
        per_expert = provider == "per-expert-inbwd"
        states = {}
        for p in (w1, w2):
            states[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            if per_expert:
                states[p]["steps"] = [_step_tensor(p, fused) for _ in range(p.shape[0])]
            else:
                states[p]["step"] = _step_tensor(p, fused)
            p.register_post_accumulate_grad_hook(_in_backward_hook(states[p], per_expert, fused))

        def run():
            _forward_backward(inputs, w1, w2, backend)

        which = "each expert slice" if per_expert else "each batched tensor"
        update = f"torch adamw(fused={fused}) on {which} in its post-accumulate-grad hook"
        return Step(inputs, run, (w1, w2), states, update=update)
    raise AssertionError(provider)


def _standard(inputs: Inputs, w1, w2, fused: bool) -> Step:
    """transformers' OlmoeExperts with its fastest implementation here, ``clip_grad_norm_``, then
    torch.optim.AdamW: fused=True when ``fused``, else torch's default flags (foreach=None, fused=None).
    Where transformers is not installed (a bare GPU machine), the experts are sonar_kernels' torch backend;
    ``Step.experts`` says which ran."""
    try:
        from transformers.models.olmoe.configuration_olmoe import OlmoeConfig
        from transformers.models.olmoe.modeling_olmoe import OlmoeExperts
    except ImportError:
        OlmoeExperts = None
    if OlmoeExperts is None:
        params, label = [w1, w2], "sonar_kernels torch backend (transformers not installed)"

        def forward():
            return sonar_kernels.moe_mlp(inputs.x, inputs.index, inputs.weights, w1, w2, backend="torch")
    else:
        E, two_I, H = w1.shape
        config = OlmoeConfig(
            hidden_size=H,
            intermediate_size=two_I // 2,
            num_experts=E,
            num_experts_per_tok=inputs.index.shape[1],
        )
        config._experts_implementation = "grouped_mm" if _grouped_mm_runs(w1) else "eager"
        experts = OlmoeExperts(config).to(device=w1.device, dtype=w1.dtype)
        experts.gate_up_proj, experts.down_proj = w1, w2
        params, label = (
            list(experts.parameters()),
            f"transformers OlmoeExperts {config._experts_implementation}",
        )

        def forward():
            return experts(inputs.x, inputs.index, inputs.weights)

    if fused:
        optimizer, update = torch.optim.AdamW(params, **HYPER, fused=True), "torch.optim.AdamW(fused=True)"
    else:
        optimizer, update = torch.optim.AdamW(params, **HYPER), "torch.optim.AdamW (default flags)"

    def run():
        inputs.backward(forward())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Step(inputs, run, (w1, w2), optimizer, forward, experts=label, update=update)


def _grouped_mm_runs(w: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs here for these weights (16-byte aligned strides, CUDA sm90+ or
    the CPU build of torch >= 2.13)."""
    try:
        a = torch.randn(4, w.shape[2], device=w.device, dtype=w.dtype)
        offs = torch.tensor([2, 4], device=w.device, dtype=torch.int32)
        torch.nn.functional.grouped_mm(a, w[:2].detach().transpose(-2, -1), offs=offs)
        return True
    except (RuntimeError, AttributeError, TypeError):
        return False


def _state_tensors(step: Step) -> list[torch.Tensor]:
    """The tensors of the step's optimizer state (a torch optimizer's, or the in-backward providers'
    {param: state} dict)."""
    if isinstance(step.optimizer, torch.optim.Optimizer):
        states = step.optimizer.state.values()
    elif isinstance(step.optimizer, dict):
        states = step.optimizer.values()
    else:
        states = []
    tensors = []
    for state in states:
        for value in state.values():
            tensors += value if isinstance(value, list) else [value]
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def peak_bytes(step: Step, phase: str = "step") -> int:
    """Peak bytes of ``step`` while it runs ``phase`` once more (its optimizer state already exists): what
    it keeps (weights, optimizer state, inputs) plus what the phase allocates.

    On a GPU, from the CUDA allocator: the peak during the phase minus whatever else was allocated before
    it (other providers' leftovers do not count). On the CPU, from torch's MemTracker with the weights and
    the optimizer state tracked.
    """
    run = step.phase(phase)
    state = _state_tensors(step)
    if step.params[0].device.type == "cuda":
        inputs = [t for t in vars(step.inputs).values() if isinstance(t, torch.Tensor)]
        kept = {  # storage -> bytes, each storage once
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in [*step.params, *state, *inputs]
            if t.is_cuda
        }
        own = sum(kept.values())
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - before + own)
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracked = list(step.params)
    if isinstance(step.optimizer, torch.optim.Optimizer):
        tracked.append(step.optimizer)
    else:
        tracked += state
    tracker.track_external(*tracked)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tracker:
            run()
    return int(sum(per_device["Total"] for per_device in tracker.get_tracker_snapshot("peak").values()))
