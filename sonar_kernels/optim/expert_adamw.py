"""ExpertAdamW: AdamW applied inside the backward pass to the expert weights it manages."""

from __future__ import annotations

import weakref

import torch
from torch.optim.adamw import adamw as torch_adamw
from torch.utils.weak import WeakIdKeyDictionary

from sonar_kernels import ops

# Expert tensor -> weak reference to the ExpertAdamW that manages it (at most one).
_MANAGER: WeakIdKeyDictionary = WeakIdKeyDictionary()


def expert_optimizer(param: torch.Tensor) -> ExpertAdamW | None:
    """The live ExpertAdamW that manages ``param`` (by identity), if any."""
    ref = _MANAGER.get(param)
    return ref() if ref is not None else None


def _as_float(value, name: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.device.type != "cpu":
            raise TypeError(f"{name} must be a Python float or a one-element CPU tensor, got {value!r}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    return float(value)


def _check_hyperparameters(lr, betas, eps, weight_decay) -> None:
    lr = _as_float(lr, "lr")
    if lr < 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        beta = _as_float(beta, f"betas[{i}]")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"betas[{i}] must be in [0, 1), got {beta}")
    if _as_float(eps, "eps") < 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if _as_float(weight_decay, "weight_decay") < 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")


class ExpertAdamW(torch.optim.Optimizer):
    """AdamW for expert weights, applied in the backward pass; no gradient tensor is ever allocated.

    The optimizer manages every tensor it is given. When a managed tensor is a weight of
    :func:`sonar_kernels.moe_mlp` / :class:`sonar_kernels.SonarExperts` on the Triton backend, the
    wgrad kernel of the backward applies AdamW in its epilogue and stores W, exp_avg and exp_avg_sq: the
    gradient exists only in registers and ``.grad`` stays None. Any other gradient that reaches a managed
    tensor (the torch backend, or a tensor used outside the expert MLP) is applied as soon as it is
    accumulated, through torch's own AdamW (``torch.optim.adamw.adamw``; for tensors that required grad when they
    were given to the optimizer), and released: the
    optimizer-in-backward of the Sonar-MoE paper, one tensor's gradient alive at a time.

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
    tensor may be updated at most once between two calls of ``step()``: a second backward through it
    raises before anything is written (accumulate gradients over micro-batches another way). Tensors
    with ``requires_grad=False`` are neither updated nor given a gradient.

    Loss scaling (``torch.amp.GradScaler``) cannot be combined with it: the update happens inside the
    backward, before a scaler could unscale the gradient or skip the step, so a scaled loss gives a
    scaled update. Train in bf16 (or fp32), which needs no loss scaling.

    Args:
        params: tensors or parameter groups, as for torch.optim.AdamW; float32/bfloat16/float16, dense.
        lr: learning rate, >= 0.
        betas: (beta1, beta2), each in [0, 1).
        eps: >= 0, added to the denominator.
        weight_decay: decoupled weight decay coefficient, >= 0.
        moments_dtype: dtype of exp_avg and exp_avg_sq (e.g. torch.float32 for bf16 weights); None:
            the parameter's dtype.
        grad_dtype: dtype the fp32 wgrad accumulator is rounded to before the AdamW math; None: the
            parameter's dtype (what a ``.grad`` would hold); torch.float32 keeps the fp32 value.
        fused_epilogue: True: AdamW in the wgrad epilogue. False: DESIGN.md's split path, the same
            wgrad kernel writing a temporary gradient (one weight tensor's worth), then a standalone
            AdamW kernel; bit-identical to the fused path, for checking it.
    Raises:
        ValueError: a hyperparameter outside its range, a tensor that is not dense, or one already
            managed by another live ExpertAdamW.
        TypeError: a tensor of an unsupported dtype, or an unsupported moments_dtype / grad_dtype.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        moments_dtype: torch.dtype | None = None,
        grad_dtype: torch.dtype | None = None,
        fused_epilogue: bool = True,
    ):
        _check_hyperparameters(lr, betas, eps, weight_decay)
        for name, dtype in (("moments_dtype", moments_dtype), ("grad_dtype", grad_dtype)):
            if dtype is not None and dtype not in ops.SUPPORTED_DTYPES:
                raise TypeError(
                    f"{name} must be None, torch.float32, torch.bfloat16 or torch.float16, got {dtype}"
                )
        self.moments_dtype = moments_dtype
        self.grad_dtype = grad_dtype
        self.fused_epilogue = bool(fused_epilogue)
        # Managed tensors updated since the last step().
        self._updated = WeakIdKeyDictionary()
        # Managed tensor -> handle of its post-accumulate-grad hook.
        self._hooked = WeakIdKeyDictionary()
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """As torch.optim.Optimizer.add_param_group; also validates the tensors, creates their state and
        registers them for the in-backward update."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        param_group = {**param_group, "params": params}  # a generator is consumed once, here
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"ExpertAdamW params must be tensors, got {type(p).__name__}")
            if p.dtype not in ops.SUPPORTED_DTYPES:
                raise TypeError(f"ExpertAdamW params must be float32, bfloat16 or float16, got {p.dtype}")
            if not ops.is_dense(p):
                raise ValueError(f"ExpertAdamW params must be dense tensors, got strides {p.stride()}")
            owner = expert_optimizer(p)
            if owner is not None and owner is not self:
                raise ValueError(
                    f"a tensor of shape {tuple(p.shape)} is already managed by another ExpertAdamW; "
                    "each expert tensor can have one in-backward optimizer"
                )
        group = {k: v for k, v in param_group.items() if k != "params"}
        _check_hyperparameters(
            group.get("lr", self.defaults["lr"]),
            group.get("betas", self.defaults["betas"]),
            group.get("eps", self.defaults["eps"]),
            group.get("weight_decay", self.defaults["weight_decay"]),
        )
        super().add_param_group(param_group)
        this = weakref.ref(self)
        for p in params:
            if p in self.state:
                continue
            moments = self.moments_dtype or p.dtype
            self.state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=p.device),
                "exp_avg": torch.zeros_like(p, dtype=moments, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, dtype=moments, memory_format=torch.preserve_format),
            }
            _MANAGER[p] = this
        self._register_hooks()

    def _register_hooks(self) -> None:
        """The in-backward update of gradients accumulated into managed tensors (the torch backend). A
        hook needs requires_grad: tensors frozen now get theirs at the next step()."""
        this = weakref.ref(self)
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and p not in self._hooked:
                    self._hooked[p] = p.register_post_accumulate_grad_hook(_apply_accumulated_grad(this))

    def _group_of(self, p: torch.Tensor) -> dict:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return group
        raise RuntimeError("ExpertAdamW: tensor not found in param_groups")

    def _check_not_updated(self, p: torch.Tensor) -> None:
        if p in self._updated:
            raise RuntimeError(
                f"ExpertAdamW: the expert tensor of shape {tuple(p.shape)} was already updated in a backward "
                "since the last optimizer.step(); call step() between backward passes (the update is applied "
                "in the backward, so a second backward would update it twice)"
            )

    def _update_for(self, p: torch.Tensor) -> ops.AdamWUpdate:
        """The update the backward applies to ``p`` now; raises if ``p`` was updated since step()."""
        self._check_not_updated(p)
        group = self._group_of(p)
        state = self.state[p]
        beta1, beta2 = group["betas"]
        return ops.AdamWUpdate(
            exp_avg=state["exp_avg"],
            exp_avg_sq=state["exp_avg_sq"],
            step=state["step"],
            lr=_as_float(group["lr"], "lr"),
            beta1=_as_float(beta1, "beta1"),
            beta2=_as_float(beta2, "beta2"),
            eps=_as_float(group["eps"], "eps"),
            weight_decay=_as_float(group["weight_decay"], "weight_decay"),
            grad_dtype=self.grad_dtype or p.dtype,
            fused=self.fused_epilogue,
        )

    def _finish_update(self, p: torch.Tensor) -> None:
        """After the kernels wrote p and its moments: record it, and bump the version counters (Triton
        writes do not), so a graph that saved the old p fails loudly instead of using new values."""
        self._updated[p] = True
        state = self.state[p]
        torch.autograd.graph.increment_version([p, state["exp_avg"], state["exp_avg_sq"]])

    def _apply_grad(self, p: torch.Tensor) -> None:
        """torch's own AdamW on an accumulated ``p.grad``, which is then released (torch backend)."""
        update = self._update_for(p)
        grad = p.grad
        p.grad = None
        # On CUDA torch's fused kernel: the arithmetic the Triton epilogue reproduces there.
        fused = p.device.type == "cuda"
        with torch.no_grad():
            torch_adamw(
                [p], [grad.to(update.exp_avg.dtype)], [update.exp_avg], [update.exp_avg_sq], [], [update.step],
                foreach=False, fused=fused, capturable=False, amsgrad=False,
                beta1=update.beta1, beta2=update.beta2, lr=update.lr, weight_decay=update.weight_decay,
                eps=update.eps, maximize=False,
            )  # fmt: skip
        self._updated[p] = True

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
        """
        loss = None
        try:
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._apply_grad(p)
        finally:
            # The step ends even when a gradient above was refused (a tensor updated twice).
            self._updated = WeakIdKeyDictionary()
            self._register_hooks()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch.optim.Optimizer.load_state_dict (a torch.optim.AdamW state_dict loads too), except:
        exp_avg and exp_avg_sq keep the dtype they were saved with (torch casts them to the parameter's
        dtype), or become ``moments_dtype`` when it was given; ``step`` becomes a float32 tensor on the
        parameter's device.

        Raises:
            ValueError: a group with amsgrad, maximize, or non-decoupled weight decay (Adam), which
                ExpertAdamW does not implement, or hyperparameters outside their ranges; a parameter
                state without moments, or moments whose shape is not the parameter's.
        """
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        for group in saved_groups:
            for key, unsupported in (
                ("amsgrad", True),
                ("maximize", True),
                ("decoupled_weight_decay", False),
            ):
                if key in group and bool(group[key]) == unsupported:
                    raise ValueError(
                        f"cannot load a state_dict with {key}={group[key]}: ExpertAdamW implements AdamW "
                        "without amsgrad and maximize"
                    )
            _check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        ids = [i for g in saved_groups for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        if len(ids) != len(params):
            raise ValueError(f"the state_dict holds {len(ids)} parameters, this optimizer {len(params)}")
        for param_id, p in zip(ids, params, strict=True):
            saved = saved_state.get(param_id, {})
            for key in ("exp_avg", "exp_avg_sq"):
                value = saved.get(key)
                if saved and not isinstance(value, torch.Tensor):
                    raise ValueError(f"the state of parameter {param_id} has no {key} tensor")
                if isinstance(value, torch.Tensor) and value.shape != p.shape:
                    raise ValueError(
                        f"{key} of parameter {param_id} has shape {tuple(value.shape)}, the parameter {tuple(p.shape)}"
                    )
        super().load_state_dict(state_dict)
        for param_id, p in zip(ids, params, strict=True):
            saved = saved_state.get(param_id, {})
            state = self.state[p]
            for key in ("exp_avg", "exp_avg_sq"):
                value = saved.get(key)
                if isinstance(value, torch.Tensor):
                    # Kept in their dtype when the kernels take it; other dtypes (fp64) as the parameter's.
                    kept = value.dtype if value.dtype in ops.SUPPORTED_DTYPES else p.dtype
                    state[key] = torch.empty_like(p, dtype=self.moments_dtype or kept).copy_(value)
                else:  # a parameter without state: fresh moments, step 0
                    state[key] = torch.zeros_like(p, dtype=self.moments_dtype or p.dtype)
            step = saved.get("step")
            state["step"] = (
                torch.as_tensor(0.0 if step is None else step, dtype=torch.float32).to(p.device).reshape(())
            )
            for key in list(state):
                if key not in ("step", "exp_avg", "exp_avg_sq"):
                    del state[key]


def _apply_accumulated_grad(optimizer_ref):
    def hook(p: torch.Tensor) -> None:
        optimizer = optimizer_ref()
        if optimizer is not None and p.grad is not None:
            optimizer._apply_grad(p)

    return hook
