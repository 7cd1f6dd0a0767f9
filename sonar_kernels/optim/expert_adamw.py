"""ExpertAdamW: AdamW applied inside the backward pass to the expert weights it manages."""

from __future__ import annotations

import torch

from sonar_kernels.ops import check_hyperparameters
from sonar_kernels.optim.in_backward import InBackwardAdamW
from sonar_kernels.optim.param_groups import check_group_options


class ExpertAdamW(InBackwardAdamW, torch.optim.Optimizer):
    """AdamW for expert weights, applied in the backward pass; no gradient tensor is ever allocated.

    The optimizer manages every tensor it is given. When a managed tensor is a weight of
    :func:`sonar_kernels.moe_mlp` / :class:`sonar_kernels.SonarExperts` on the Triton backend, the
    wgrad kernel of the backward applies AdamW in its epilogue and stores W, exp_avg and exp_avg_sq: the
    gradient exists only in registers and ``.grad`` stays None. Any other gradient that reaches a managed
    tensor (the torch backend, or a tensor used outside the expert MLP) is applied as soon as it is
    accumulated, through torch's own AdamW (``torch.optim.adamw.adamw``; for tensors that required grad when they
    were given to the optimizer), and released: the
    optimizer-in-backward of the Sonar-MoE paper, one tensor's gradient alive at a time (on the torch
    backend with torch's fused AdamW, one chunk of experts' gradient: docs/design.md).

    That torch AdamW is its fused kernel (``torch.optim.AdamW(fused=True)``'s) wherever torch has one
    for the tensor's device and dtype, the CPU and CUDA among them (the rule:
    ``sonar_kernels.optim.param_groups.torch_adamw_flags``): one pass over the tensor, no temporaries, a
    non-finite gradient skipped on the device (its ``found_inf`` input, no host sync), and on the CPU
    several times faster than the for-loop AdamW torch picks there by default; the update is then
    bitwise torch.optim.AdamW(fused=True)'s given the same gradient. Elsewhere torch's default. A
    parameter group's own ``foreach`` or ``fused`` key (torch.optim.AdamW's flags, e.g.
    ``{"params": [...], "fused": False}`` for the for-loop) keeps torch's meaning.

    The update is torch.optim.AdamW's (decoupled weight decay, bias correction, ``step`` incremented
    first). The fused kernels use the arithmetic of torch's fused AdamW on the device (on CUDA, that of
    the installed torch; see ``sonar_kernels/kernels/adamw.py``); by default the fp32 wgrad is first rounded to the parameter's
    dtype, so the update is the one standard training makes from a ``.grad`` of that dtype.

    lr, betas, eps and weight_decay are read from the parameter's group in ``param_groups`` when the
    backward runs, so torch.optim.lr_scheduler works unchanged. ``state[p]`` has torch.optim.AdamW's
    keys: ``step`` (0-dim float32 on the parameter's device, as torch's fused AdamW keeps it),
    ``exp_avg`` and ``exp_avg_sq`` (the parameter's dtype unless ``moments_dtype`` is given), created
    here, not lazily.

    ``step()`` applies nothing (the updates happened in the backward); it ends the step. Each managed
    tensor may be updated at most once between two calls of ``step()``: one backward more than
    ``accumulation_steps`` raises before anything is written. Tensors
    with ``requires_grad=False`` are neither updated nor given a gradient.

    Non-finite gradients: a tensor's update is skipped as a whole (weights, moments and step unchanged)
    when its gradient has an entry that is NaN, infinite or beyond ``ops.grad_limit`` (2**63 for fp32
    and bf16 moments, 128 for fp16 ones, so that exp_avg_sq stays finite); overflow when the fp32 wgrad
    is rounded to ``grad_dtype`` counts. On the Triton backend the decision is made on the device before
    the update's launch (a bound from the wgrad's inputs, and an exact check pass of the wgrad kernel
    only when the bound cannot exclude it). ``expert_skipped_updates()`` counts the skips on the device;
    ``expert_grad_norm()`` reports inf for a skipped tensor.

    Loss scaling (``torch.amp.GradScaler``) cannot be combined with it: the update happens inside the
    backward, before a scaler could unscale the gradient or skip the step, so the backward of a loss an
    enabled GradScaler scaled raises RuntimeError before any update (``optim/loss_scaling.py``). Train in
    bf16 (or fp32), which needs no loss scaling.

    Args:
        params: tensors or parameter groups, as for torch.optim.AdamW; float32/bfloat16/float16, dense.
        lr: learning rate, >= 0.
        betas: (beta1, beta2), each in [0, 1).
        eps: >= 0, added to the denominator.
        weight_decay: decoupled weight decay coefficient, >= 0.
        moments_dtype: dtype of exp_avg and exp_avg_sq (e.g. torch.float32 for bf16 weights); None:
            the parameter's dtype; "8bit": 8-bit codes and fp32 block scales for the weight matrices
            (``state[p]``: ``exp_avg_codes``, ``exp_avg_scales``, ``exp_avg_sq_codes``,
            ``exp_avg_sq_scales``), biases exact (docs/design.md, "8-bit moments"; docs/usage.md).
        grad_dtype: dtype the fp32 wgrad accumulator is rounded to before the AdamW math; None: the
            parameter's dtype (what a ``.grad`` would hold); torch.float32 keeps the fp32 value.
        fused_epilogue: True: AdamW in the wgrad epilogue, no gradient tensor (the least memory). False:
            docs/design.md's split path, the same wgrad kernel writing the gradient of a chunk of experts
            into a scratch buffer (at most 1/8 of the tensor's gradient bytes or 64 MiB, whichever is
            larger), then a standalone AdamW kernel, chunk after chunk; bit-identical to the fused path at
            the same tiles. None (the default): the faster of the two, timed on the first step of each
            layer shape on CUDA (docs/benchmarks.md, "The update's path"); the fused path off CUDA.
        accumulation_steps: k micro-batches per optimizer step (gradient accumulation). The gradients
            of micro-batches 1 .. k-1 are summed in ``.grad`` as autograd does, in the parameter's
            dtype (one gradient tensor per expert tensor lives between micro-batches: 2 bytes per
            element for bf16), which gives the sum standard training gets; with a ``grad_dtype`` other
            than the parameter's (``torch.float32`` for bf16 weights) they are summed in a buffer of
            that dtype that the optimizer holds instead (4 bytes per element for float32; on the
            Triton backend the wgrad kernel adds its fp32 result to it unrounded; ``zero_grad()``
            releases it with ``.grad``). The k-th backward adds its own wgrad to that sum in the
            epilogue and applies the update. ``step()`` applies a window cut short (through torch's
            AdamW). Default 1: no gradient tensor is ever allocated.
        data_parallel_group: the torch.distributed ProcessGroup (or 1-D DeviceMesh) over which the expert
            tensors are replicated (data parallelism). Their gradient then reaches ``.grad``, is averaged
            over the group by an asynchronous all-reduce (divided by the group's size, then summed, as
            DDP does) while the backward goes on, and the update is applied when the reduction is done:
            at most two expert tensors in flight, all done by the end of the backward. Keep these tensors
            out of DDP's reducer (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``;
            SonarAdamW does it for the module it is given). None: no reduction; with more than one rank
            in the job, only sharded (DTensor, FSDP2) and expert-parallel
            (``specs.mark_expert_parallel``) expert tensors are accepted.
        master_weights: None, or "remainder" (docs/design.md, "bf16 master weights"): each bf16 expert
            tensor stays the model's plain bf16 tensor, and ``state[p]["remainder"]`` (int16, its shape)
            completes it to an fp32 master, updated by torch's AdamW with fp32 moments (``moments_dtype``
            None or torch.float32) and split again, so the master follows torch.optim.AdamW on fp32 master
            weights bit for bit (on the Triton backend: in its AdamW arithmetic, in the wgrad epilogue)
            and the weight is the master rounded to nearest (a tie away from zero).
            A checkpoint without a remainder (bf16 weights alone, or torch.optim.AdamW's) loads with
            remainder 0 (the bf16 weight is the master). "stochastic": each bf16 expert tensor is updated
            in fp32 (fp32 moments) and rounded back to bf16 stochastically, unbiased, with a counter-based
            stream keyed by (``state[p]["seed"]``, the step, the element), the same bits in every run (on
            the Triton backend in the wgrad epilogue, the same bits as its split path).
        rounding_seed: the seed of the stochastic rounding's streams (each tensor's: ``state[p]["seed"]``,
            from it and the tensor's position among those the optimizer was given).
        expert_clipping, spike_threshold: "none" (default) or "spike", as SonarAdamW takes them (SPAM's
            spike rule inside the update; ``expert_clipped_elements()`` counts it); "lagged" needs the global
            norm over all parameters and is SonarAdamW's.
    Raises:
        ValueError: a hyperparameter outside its range, a tensor that is not dense, a parameter group with
            maximize, amsgrad, capturable, differentiable or decoupled_weight_decay=False, or, with more
            than one rank, an expert tensor that is neither sharded, expert-parallel nor covered by
            ``data_parallel_group`` (also raised as RuntimeError by a backward, before any update, when
            torch.distributed was initialized after the optimizer was built).
        TypeError: a tensor of an unsupported dtype, or an unsupported moments_dtype / grad_dtype.
        ValueError: with 8-bit moments, a weight matrix whose last dimension is not a multiple of 32 or
            that is not contiguous; a master_weights other than None, "remainder" or "stochastic", or with
            moments other than fp32.
        TypeError: with master_weights, an expert tensor that is not bf16.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        moments_dtype: torch.dtype | str | None = None,
        grad_dtype: torch.dtype | None = None,
        fused_epilogue: bool | None = None,
        accumulation_steps: int = 1,
        data_parallel_group=None,
        master_weights: str | None = None,
        rounding_seed: int = 0,
        expert_clipping: str = "none",
        spike_threshold: float = 5000.0,
    ):
        check_hyperparameters(lr, betas, eps, weight_decay)
        if expert_clipping == "lagged":
            raise ValueError(
                'expert_clipping="lagged" needs the global norm over all parameters, which ExpertAdamW does not '
                'see (it holds the expert tensors only): use SonarAdamW(max_grad_norm=..., expert_clipping="lagged"), '
                'or "spike"'
            )
        self._init_in_backward(
            moments_dtype, grad_dtype, fused_epilogue, accumulation_steps, data_parallel_group, master_weights,
            rounding_seed, expert_clipping, spike_threshold,
        )  # fmt: skip
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """As torch.optim.Optimizer.add_param_group; also validates the tensors, creates their state and
        registers them for the in-backward update."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        # A generator is consumed once, here. A plain dict (torch.compile traces no dict subclass in
        # param_groups): the backward reads the group when it runs, step() checks it (InBackwardAdamW).
        param_group = {**param_group, "params": params}
        check_group_options(type(self).__name__, param_group, bool(params))
        self.managed.check(params)
        check_hyperparameters(
            param_group.get("lr", self.defaults["lr"]),
            param_group.get("betas", self.defaults["betas"]),
            param_group.get("eps", self.defaults["eps"]),
            param_group.get("weight_decay", self.defaults["weight_decay"]),
        )
        super().add_param_group(param_group)
        self.managed.manage(params)

    @torch.no_grad()
    def step(self, closure=None):
        """Ends the optimizer step: the expert tensors were updated in the backward.

        A gradient found on a managed tensor (one that had requires_grad=False when it was given to the
        optimizer, so its in-backward hook came later) is applied here, once, through torch's AdamW and
        released.

        Args:
            closure: optional, re-evaluates the model and returns the loss (its backward applies the
                updates), as for torch.optim optimizers.
        Returns:
            The closure's loss, or None.
        Raises:
            RuntimeError: before anything changes (the step does not end), when a hyperparameter of a group
                whose tensors were updated in this step's backward changed since that update: it came too
                late for this step (set it back, or set it after step()).
        """
        loss = self._run_closure_and_end_step(closure)
        return loss
