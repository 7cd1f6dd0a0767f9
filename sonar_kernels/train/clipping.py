"""sonar-train's expert-clipping arms (``--expert-clipping``, SonarAdamW's ``expert_clipping=``): their
names, the bitwise controls of sonar-spike and sonar-lagged with the rules written plainly, the telemetry
recorded per step, and their lines in the printed summary (the verdicts themselves: ``verdicts``)."""

from __future__ import annotations

import torch

from sonar_kernels.ops import has_torch_fused_adamw
from sonar_kernels.ops.torch_backend import mlp as torch_backend
from sonar_kernels.ops.torch_backend.expert_gradient import expert_chunks
from sonar_kernels.train.stats import nats

# sonar-spike: SPAM's spike rule inside the in-backward update; sonar-lagged: the experts scaled by the
# previous step's global clipping coefficient; each with its control (materialized gradients, the rule
# applied by hand before torch.optim.AdamW), run on the first seed and compared bit for bit.
# (CLIPPING_ARMS, their names, and SPIKE_THRESHOLD, SPAM's default theta, are the command line's:
# sonar_kernels_cli.options.)
CLIPPING_CONTROLS = {"sonar-spike": "spike-control", "sonar-lagged": "lagged-control"}
# The expert_clipping mode of each clipping arm, sonar arm and control alike.
CLIPPING_MODE = {"sonar-spike": "spike", "spike-control": "spike", "sonar-lagged": "lagged",
                 "lagged-control": "lagged"}  # fmt: skip


class _Control:
    """What both controls share: one torch.optim.AdamW (``self.optimizer``) seen as the arm's optimizer."""

    optimizer: torch.optim.Optimizer

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]

    @property
    def state(self) -> dict:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)


class SpikeControl(_Control):
    """The control of SonarAdamW(expert_clipping="spike") ("spike-control"), with standard machinery over
    ``params`` (the model's trainable parameters in its order; ``experts`` the expert tensors among them):
    materialized gradients, the dense ones clipped by the caller by their own norm (as SonarAdamW clips
    them), then in ``step()`` each expert tensor's gradient passed through
    :func:`spike_clip` (SPAM's rule as ``sonar_kernels.reference.spike_clip`` states it: an element with
    g^2 > ``threshold`` * v replaced by sign(g) sqrt(``threshold`` * v)) with v its ``exp_avg_sq`` in this torch.optim.AdamW's
    state before the step's update (none before the first step: v 0, nothing replaced), and one
    torch.optim.AdamW step with ``flags`` over every parameter. Its parameters must equal sonar-spike's bit
    for bit; ``last_clipped`` (a 0-dim int64 tensor) counts the elements replaced in the last step, as
    ``SonarAdamW.expert_clipped_elements()`` does."""

    def __init__(self, params: list, experts: list, hyper: dict, flags: dict, threshold: float):
        self.experts = experts
        self.optimizer = torch.optim.AdamW(params, **hyper, **flags)
        self.threshold = threshold
        self.last_clipped: torch.Tensor | None = None

    def step(self) -> None:
        clipped = torch.zeros((), dtype=torch.int64)
        for p in self.experts:
            state = self.optimizer.state.get(p)
            if p.grad is None or not state:  # no gradient, or no second moment yet (v 0: nothing replaced)
                continue
            grad, count = spike_clip(p.grad, state["exp_avg_sq"], self.threshold)
            p.grad.copy_(grad)
            clipped += count.cpu()
        self.last_clipped = clipped
        self.optimizer.step()


class LaggedControl(_Control):
    """The control of SonarAdamW(expert_clipping="lagged") ("lagged-control"), with standard machinery over
    ``params`` (the model's trainable parameters in its order; ``experts`` the expert tensors among them):
    materialized gradients; in ``step()`` the global L2 norm of this step's gradients over all parameters
    (dense and experts, before any scaling; :func:`lagged_global_norm`) clips the dense gradients
    (``clip_grads_with_norm_``, as clip_grad_norm_ over all parameters would), the expert gradients are
    multiplied by the coefficient of the previous step's norm (:func:`lagged_clip_coef`,
    min(1, ``max_grad_norm`` / (norm + 1e-6)) in fp32; nothing at the first step; a norm that is not finite
    keeps the previous coefficient, as SonarAdamW does), then one torch.optim.AdamW step with ``flags`` over
    every parameter. Its parameters must equal sonar-lagged's bit for bit.
    ``last_grad_norm``: this step's global norm; ``coef``: the coefficient the next step's expert gradients
    will be multiplied by (a 0-dim fp32 tensor, as ``SonarAdamW.expert_clip_coef``)."""

    def __init__(self, params: list, experts: list, hyper: dict, flags: dict, max_grad_norm: float):
        self.experts = experts
        self.dense = [p for p in params if not any(p is q for q in experts)]
        self.optimizer = torch.optim.AdamW(params, **hyper, **flags)
        self.max_grad_norm = max_grad_norm
        self.fused = bool(flags["fused"])
        self.coef = torch.ones((), dtype=torch.float32)
        self.last_grad_norm: torch.Tensor | None = None
        self._stepped = False

    def step(self) -> None:
        dense = [p for p in self.dense if p.grad is not None]
        experts = [p.grad for p in self.experts if p.grad is not None]
        norm = lagged_global_norm([p.grad for p in dense], experts, self.fused)
        torch.nn.utils.clip_grads_with_norm_(dense, self.max_grad_norm, norm)
        if self._stepped:  # the first step's coefficient is 1: the gradients as they are
            for grad in experts:
                # The product in fp32, rounded once to the gradient's dtype (torch's CPU grad.mul_(coef); a
                # CUDA mul_ would round coef to a bf16 gradient's dtype first).
                grad.copy_(grad.float() * self.coef.to(grad.device))
        # A norm that is not finite (an update skipped for a non-finite gradient) keeps the coefficient.
        coef = lagged_clip_coef(norm, self.max_grad_norm)
        self.coef = torch.where(torch.isfinite(norm), coef, self.coef.to(coef.device))
        self.last_grad_norm = norm
        self._stepped = True
        self.optimizer.step()


# The controls' rules, written plainly here: the package does not run sonar_kernels.reference (the tests'
# oracle; pyproject.toml's import contract), and the controls do not run the library's own clipping
# (rules/clipping.py), which they check. tests/test_train_clipping.py checks both against the reference.


def spike_clip(
    grad: torch.Tensor, exp_avg_sq: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """SPAM's spike rule (Huang et al., ICLR 2025, arXiv 2501.06842) as :func:`sonar_kernels.reference.spike_clip`
    states it: where g^2 > theta v and v > 0 (g, v as fp32, theta = ``threshold`` rounded to fp32), g is
    replaced by sign(g) sqrt(theta v), the square root correctly rounded to fp32; the result rounded to
    ``grad``'s dtype. Returns (the clipped gradient, the number of replaced elements as a 0-dim int64
    tensor on ``grad``'s device)."""
    g = grad.float()
    v = exp_avg_sq.float()
    limit = v * torch.tensor(threshold, dtype=torch.float32)
    spike = (g * g > limit) & (v > 0)
    bound = torch.sqrt(limit.double()).float()  # torch's fp32 sqrt on the CPU is not always correctly rounded
    return torch.where(spike, torch.copysign(bound, g), g).to(grad.dtype), spike.sum()


def lagged_clip_coef(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's clipping coefficient of ``total_norm`` (``clip_grads_with_norm_``), min(1, ``max_norm`` /
    (norm + 1e-6)) in fp32, as :func:`sonar_kernels.reference.lagged_clip_coef` states it: the factor of
    the next step's expert gradients under ``expert_clipping="lagged"``."""
    return torch.clamp(max_norm / (total_norm.float() + 1e-6), max=1.0)


def lagged_global_norm(dense: list[torch.Tensor], experts: list[torch.Tensor], fused: bool) -> torch.Tensor:
    """The global L2 norm over the dense and the expert gradients with SonarAdamW's arithmetic for
    ``expert_clipping="lagged"`` (optim/sonar_adamw.py, ``step()``): torch's ``get_total_norm`` of the dense
    ones; the experts' norm the square root of their squared norms (:func:`expert_norm_sq`) summed in
    order from an fp32 zero (``expert_grad_norm()``); sqrt(dense^2 + experts^2)."""
    dense_norm = torch.nn.utils.get_total_norm(dense)
    expert_sq = torch.zeros((), dtype=torch.float32, device=dense_norm.device)
    for grad in experts:
        expert_sq = expert_sq + expert_norm_sq(grad, fused).to(expert_sq.device)
    return torch.sqrt(dense_norm.square() + expert_sq.sqrt().square())


def expert_norm_sq(grad: torch.Tensor, fused: bool) -> torch.Tensor:
    """The squared L2 norm of an expert tensor's gradient (experts along dim 0) as the torch backend's
    in-backward update records it (ops/torch_backend/adamw.py, ``torch_adamw_chunked_``): on the CPU under torch's fused
    AdamW (``fused``) the experts in chunks of at most ``torch_backend.WGRAD_CHUNK_BYTES`` of gradient
    (``ops/expert_gradient.expert_chunks``, the geometry of ``ExpertGradient.chunks``),
    each chunk's dot product with itself (fp32 and contiguous; else its fp32 ``vector_norm`` squared)
    summed in order from an fp32 zero; as one chunk (a GPU, another AdamW, a small tensor)
    ``vector_norm(grad, dtype=float32)`` squared. The norm's summation order is the arm's, so that the
    control's clipping coefficients are the arm's bits; the Triton kernels sum in their own order (the
    control is bitwise on the torch backend only, as standard-dense-clip is)."""
    chunks = [(0, grad.shape[0])]
    if fused and grad.device.type == "cpu" and has_torch_fused_adamw(grad.device, grad.dtype):
        chunks = expert_chunks(tuple(grad.shape), grad.element_size(), torch_backend.WGRAD_CHUNK_BYTES)
    if len(chunks) == 1:
        return torch.linalg.vector_norm(grad, dtype=torch.float32).square()
    total = torch.zeros((), dtype=torch.float32, device=grad.device)
    for first, last in chunks:
        chunk = grad[first:last]
        if chunk.dtype == torch.float32 and chunk.is_contiguous():
            flat = chunk.view(-1)
            total += torch.dot(flat, flat)
        else:
            total += torch.linalg.vector_norm(chunk, dtype=torch.float32).square()
    return total


def clipping_telemetry(name: str, optimizer) -> torch.Tensor:
    """The expert clipping of the step arm ``name`` just took, a 0-dim device tensor: the elements the spike
    rule replaced (sonar-spike: ``expert_clipped_elements()``; its control: counted by hand), or the lagged
    coefficient the next step's expert gradients will be multiplied by (sonar-lagged: ``expert_clip_coef``;
    its control's ``coef``)."""
    if name == "sonar-spike":
        return optimizer.expert_clipped_elements().clone()
    if name == "sonar-lagged":
        return optimizer.expert_clip_coef.clone()
    if name == "spike-control":
        return optimizer.last_clipped
    return optimizer.coef.clone()


def clipping_lines(report: dict) -> list[str]:
    """The expert-clipping arms' block of the summary (report.json's ``expert_clipping``): per arm its
    held-out differences to standard and to sonar over paired seeds with their verdicts, its peak memory
    and step time against sonar's, and its clipping telemetry; empty when no such arm ran."""
    clipping = report.get("expert_clipping")
    if not clipping:
        return []
    spike = report.get("inject_spike")
    injected = (
        f"spike injected: step {spike['step']}'s loss x{spike['scale']:g} in every arm"
        if spike is not None
        else "no spike injected"
    )
    lines = ["", f"expert clipping ({injected}; held-out differences over paired seeds, nats per byte):"]
    for name, entry in clipping.items():
        for reference in ("standard", "sonar"):
            held = entry.get(f"versus_{reference}")
            if held is None:
                continue
            se = held["standard_error"]
            pm = f" ± {se:.4f} (SE)" if se is not None else ""
            lines.append(
                f"  {name} - {reference}: {' '.join(f'{d:+.4f}' for d in held['deltas'])}; mean "
                f"{nats(held['mean_delta'])}{pm}; verdict: {held['verdict']}"
            )
        parts = []
        if entry.get("peak_memory_ratio_to_sonar") is not None:
            parts.append(f"peak memory / sonar's {entry['peak_memory_ratio_to_sonar']:.4f}")
        if "step_time_ratio_to_sonar" in entry:
            ratio = entry["step_time_ratio_to_sonar"]
            parts.append(
                f"median step time / sonar's {ratio:.3f}x"
                if ratio is not None
                else f"step time / sonar's: {entry['step_time_note']}"
            )
        if name == "sonar-spike":
            what = (
                f"elements replaced by the spike rule (theta {report['spike_threshold']:g}) per seed: "
                + " ".join(str(n) for n in entry["clipped_elements"])
            )
            if "clipped_elements_at_spike" in entry:
                what += f", at step {spike['step']}: " + " ".join(
                    str(n) for n in entry["clipped_elements_at_spike"]
                )
        else:
            what = "smallest lagged coefficient per seed: " + " ".join(
                f"{c:.3g}" for c in entry["smallest_coef"]
            )
            if "coef_after_spike" in entry:
                what += f", set by step {spike['step']}: " + " ".join(
                    f"{c:.3g}" for c in entry["coef_after_spike"]
                )
        parts.append(what)
        lines.append(f"  {name}: {'; '.join(parts)}")
    return lines


def spike_effect_lines(report: dict) -> list[str]:
    """The summary's lines of report.json's ``spike_effect`` (``--spike-baseline``): per arm, the held-out
    loss with the spike minus without it over paired seeds, with its verdict; empty without it."""
    effect = report.get("spike_effect")
    if effect is None:
        return []
    spike = report["inject_spike"]
    lines = [
        "",
        f"spike effect (held-out loss with step {spike['step']}'s loss x{spike['scale']:g} minus the same run "
        f"without it, {effect['baseline']}; paired over the seeds, positive: the spike hurt):",
    ]
    for name, held in effect["arms"].items():
        se = held["standard_error"]
        pm = f" ± {se:.4f} (SE)" if se is not None else ""
        lines.append(
            f"  {name:<20} {' '.join(f'{d:+.4f}' for d in held['deltas'])}; mean {nats(held['mean_delta'])}{pm}; "
            f"verdict: {held['verdict']}"
        )
    return lines
