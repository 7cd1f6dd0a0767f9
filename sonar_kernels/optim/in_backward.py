"""The in-backward AdamW machinery shared by ExpertAdamW and SonarAdamW.

(About 1,000 lines: one state machine (ownership and adoption, micro-batch accumulation, the hook path,
reentrant checkpointing's held gradients, the hyperparameter checks, checkpoints) over one set of private
per-tensor tables; split across modules, those tables would be shared private state. A split by
concern behind public seams is the next step; optim/ownership.py already holds what needs no private table.)

A tensor "managed" here is updated inside the backward pass. The optimizer attaches an
:class:`sonar_kernels.specs.ExpertUpdate` to it (``_OwnedUpdate``: the state tensors, and the
bookkeeping the autograd layer calls in eager mode), so that the expert MLP's backward applies the
update itself: in the Triton wgrad epilogue, or through torch's AdamW right after its gradient is
computed (the torch backend); in eager mode once the tensor's whole gradient is known (the pre-hook of
its AccumulateGrad node, with the parts of other uses of the tensor added: docs/design.md, "When the
updates run"). A gradient that reaches ``.grad`` instead (a weight passed to the MLP as a
cast or another copy, a penalty on the weights, FSDP2's reduced shard) is applied by the optimizer's
post-accumulate-grad hook on the tensor, then released.

Each managed tensor carries at most one update and one hook of this library: the newest optimizer owns
it (an older one lets it go), and both are removed when their optimizer is garbage-collected.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor

from sonar_kernels import ops, specs
from sonar_kernels.ops.adamw import has_torch_fused_adamw
from sonar_kernels.ops.common import like
from sonar_kernels.ops.validation import as_float
from sonar_kernels.optim import distributed, loss_scaling
from sonar_kernels.specs import is_expert_tensor, mark_expert_tensors, update_of

__all__ = ["InBackwardAdamW", "expert_optimizer", "is_expert_tensor", "mark_expert_tensors"]


def expert_optimizer(param: torch.Tensor):
    """The live optimizer that updates ``param`` in the backward (the one whose update it carries), or None."""
    update = update_of(param)
    return update.optimizer if isinstance(update, _OwnedUpdate) else None


class _OwnedUpdate(specs.ExpertUpdate):
    """The update of one managed tensor, with its owner's bookkeeping. It holds the optimizer weakly and
    the tensor not at all (by its id, which the optimizer maps back to it while it holds it): the update is
    an attribute of the tensor, and a weak reference to a parameter would make ``torch.utils.swap_tensors``
    (module conversions in swap mode) refuse it.

    ``signature``: the tensor's (dtype, device, shape) when the update was built; a conversion of the
    tensor since (``module.to(...)``, in place or by swapping) shows as another signature."""

    def __init__(self, optimizer, param: torch.Tensor, **fields):
        super().__init__(**fields)
        self._optimizer = weakref.ref(optimizer)
        self._key = id(param)
        self.signature = signature(param)
        # The autograd graphs recorded over the tensor that have not run their backward yet.
        self.live = weakref.WeakSet()
        self._buffer = None

    @property
    def optimizer(self):
        return self._optimizer()

    def _lookup(self):
        """(the optimizer, the tensor), or Nones once the optimizer was garbage-collected."""
        optimizer = self._optimizer()
        return optimizer, None if optimizer is None else optimizer._held_by_id.get(self._key)

    def _owner(self):
        optimizer, param = self._lookup()
        if optimizer is None or param is None:
            raise RuntimeError("the optimizer that owned this expert tensor was garbage-collected")
        return optimizer, param

    def accumulating(self) -> bool:
        optimizer, param = self._owner()
        return optimizer._accumulating(param)

    def track(self, graph) -> None:
        # A graph recorded while a backward runs is activation checkpointing's recomputation: non-reentrant,
        # it is thrown away once its saved tensors are taken, though a collective can hold one of its tensors
        # a while longer (gloo's and NCCL's work objects keep their inputs until their own threads release
        # them), which kept it in this set when the running backward came to the update; reentrant, its
        # backward runs at once, nested in the running one. Neither is another graph whose backward would
        # see updated weights, so neither is tracked (a graph recorded in a backward hook and backpropagated
        # after the update is still refused, by _Watched.check_unchanged, before its backward writes anything).
        if torch._C._current_graph_task_id() == -1:
            self.live.add(graph)
        optimizer, param = self._lookup()
        if optimizer is not None and param is not None:
            optimizer._without_graph.pop(param, None)  # a forward with a graph came after it

    def untrack(self, graph) -> None:
        self.live.discard(graph)

    def begin_backward(self, graph) -> None:
        optimizer, param = self._owner()
        self.live.discard(graph)
        if update_of(param) is not self:
            raise RuntimeError(
                f"an expert tensor of shape {tuple(param.shape)}: its in-backward update changed between this "
                "graph's forward and its backward (an optimizer was built over it, or load_state_dict() replaced "
                "its state), so the state this forward recorded is no longer the optimizer's; nothing was "
                "updated: run the forward again"
            )
        if len(self.live):
            raise RuntimeError(
                f"an expert tensor of shape {tuple(param.shape)}: {len(self.live)} other live autograd graph(s) use "
                f"it, which {type(optimizer).__name__} updates in this backward; their backward would then see the "
                "updated weights. Call the experts once per forward (or once per backward), or free the other "
                "graph first."
            )
        optimizer._check_may_update(param)
        optimizer._check_no_user_hooks(param)

    def grad_in(self, other=None):
        optimizer, param = self._owner()
        return optimizer._grad_in(param, other)

    def hyperparameters(self):
        optimizer, param = self._owner()
        return optimizer._torch_hyperparameters(optimizer._group_of(param))

    def add_to_buffer(self, other) -> None:
        """Add ``other`` (the gradient the tensor's other producers gave in this backward, or None) to
        the micro-batch buffer the backward just added to."""
        if other is not None:
            optimizer, param = self._owner()
            with torch.no_grad():
                optimizer._buffers[param].add_(other)

    def accumulation_buffer(self):
        optimizer, param = self._owner()
        accumulator = optimizer._accumulator_for(param)
        if accumulator is None:
            return None
        self._buffer = accumulator.buffer
        return accumulator.buffer, accumulator.add

    def finish(self, applied: bool) -> None:
        optimizer, param = self._owner()
        if applied:
            optimizer._finish_update(param)
        else:
            optimizer._accumulated_into(param, self._buffer)
        self._buffer = None

    def compiled_update(self) -> None:
        optimizer, param = self._owner()
        optimizer._check_may_update(param)
        optimizer._updated[param] = True
        optimizer._updated_in_backward[param] = True

    def forward_without_graph(self) -> None:
        optimizer, param = self._owner()
        optimizer._without_graph[param] = True

    def forward_in_backward(self, accumulates: bool) -> bool:
        optimizer, param = self._owner()
        optimizer._without_graph.pop(param, None)
        if accumulates:
            optimizer._hold_until_backward_ends(param)
        return optimizer._arrived_in.get(param) == torch._C._current_graph_task_id()


# torch.optim.AdamW options the in-backward update does not implement, with the only value it accepts for
# a parameter group that holds expert tensors (foreach and fused pick torch's AdamW path and are honoured;
# lr may be a one-element CPU tensor).
UNSUPPORTED_OPTIONS = {
    "maximize": False,
    "amsgrad": False,
    "capturable": False,
    "differentiable": False,
    "decoupled_weight_decay": True,
}


def check_group_options(owner: str, group: dict, has_experts: bool) -> None:
    """Raise ValueError, naming the option, when ``group`` holds expert tensors (``has_experts``) and sets
    an option of :data:`UNSUPPORTED_OPTIONS` to another value than the one the update implements; a group
    without expert tensors takes every torch.optim.AdamW option. The one check of every path that gives a
    group expert tensors or an option: the constructor and ``add_param_group`` (``group`` with the
    constructor's defaults filled in), an option set later, ``load_state_dict`` (the saved group), an
    expert tensor adopted at its module's first forward."""
    if not has_experts:
        return
    for key, accepted in UNSUPPORTED_OPTIONS.items():
        if key in group and group[key] is not None and bool(group[key]) != accepted:
            raise ValueError(
                f"{owner}: a parameter group with {key}={group[key]!r} (its own or the constructor's) holds "
                f"expert tensors, which are updated in the backward by AdamW without {key} (only "
                f"{key}={accepted} is implemented); put the expert tensors in a group that sets "
                f'"{key}": {accepted}'
            )


def torch_adamw_flags(group: dict, tensors: list[torch.Tensor]) -> tuple[bool | None, bool | None]:
    """(foreach, fused): the flags for torch's AdamW on ``tensors`` of the parameter group ``group``, the
    one rule of SonarAdamW and ExpertAdamW wherever torch's AdamW applies an update.

    The group's ``foreach`` and ``fused`` when one of them is set (torch's meaning: fused=False or
    foreach=False the for-loop, foreach=True the foreach kernels), or when the group asks for capturable
    or differentiable (torch's own choice then, as torch.optim.AdamW makes it). Otherwise torch's fused
    AdamW, ``(None, True)``, where torch has it for every tensor's device and dtype
    (:func:`has_torch_fused_adamw`) and the tensors are all DTensors or none (torch's fused AdamW refuses
    a call that mixes them): one pass over each tensor, no temporaries, a ``found_inf`` input (no
    host sync to skip a non-finite gradient); on the CPU several times faster than the for-loop AdamW
    torch picks there by default (3 to 4 times per thread for tensors of 1M to 4M fp32 elements, torch
    2.13). ``(None, None)`` (torch's default) where it has none.
    """
    foreach, fused = group.get("foreach"), group.get("fused")
    if foreach is not None or fused is not None or group.get("capturable") or group.get("differentiable"):
        return foreach, fused
    one_kind = len({isinstance(t, DTensor) for t in tensors}) == 1
    if one_kind and all(has_torch_fused_adamw(t.device, t.dtype) for t in tensors):
        return None, True
    return None, None


def _release(entries: list, previous: dict) -> None:
    """Remove the hooks and updates of a garbage-collected optimizer (entries: [tensor, update, hook
    handle or None]); a tensor it took from an optimizer still alive goes back to that one
    (``previous``: tensor -> weak reference to it), so the tensor is never left without its owner."""
    for param, update, handle in entries:
        if handle is not None:
            handle.remove()
        if update_of(param) is update:
            specs.attach_update(param, None)
            before = previous.get(param)
            before = before() if before is not None else None
            if before is not None:
                before._take_back(param)
    entries.clear()


class InBackwardAdamW:
    """Mixin for a torch.optim.Optimizer whose managed tensors are updated in the backward pass.

    The host class calls :meth:`_init_in_backward` before ``Optimizer.__init__`` and :meth:`_manage` for the
    tensors to update in the backward (state created there, torch.optim.AdamW's layout), and
    :meth:`_end_step` at the end of its ``step()``.
    """

    def _init_in_backward(
        self, moments_dtype, grad_dtype, fused_epilogue, accumulation_steps=1, data_parallel_group=None
    ) -> None:
        if (
            isinstance(accumulation_steps, bool)
            or not isinstance(accumulation_steps, int)
            or accumulation_steps < 1
        ):
            raise ValueError(f"accumulation_steps must be an int >= 1, got {accumulation_steps!r}")
        self.accumulation_steps = accumulation_steps
        loss_scaling.install()  # a backward of a GradScaler-scaled loss is refused before any update
        # The group over which the expert tensors are replicated; their gradients are averaged over it
        # before their update (optim/distributed.py).
        self.data_parallel_group = distributed.resolve_group(data_parallel_group)
        self._reducer = (
            distributed.GradientReducer(self.data_parallel_group)
            if self.data_parallel_group is not None
            else None
        )
        # The per-tensor tables below are keyed by the tensors themselves (identity, as torch.optim's
        # ``state``), never by weak references: torch.utils.swap_tensors refuses a tensor that has one.
        # Managed tensor -> micro-batch gradients accumulated since the last step(): in its .grad, or in
        # its buffer in _buffers when grad_dtype is not its dtype (.grad must have the tensor's dtype).
        self._micro = {}
        self._buffers = {}
        for name, dtype in (("moments_dtype", moments_dtype), ("grad_dtype", grad_dtype)):
            if dtype is not None and dtype not in ops.SUPPORTED_DTYPES:
                raise TypeError(
                    f"{name} must be None, torch.float32, torch.bfloat16 or torch.float16, got {dtype}"
                )
        self.moments_dtype = moments_dtype
        self.grad_dtype = grad_dtype
        self.fused_epilogue = bool(fused_epilogue)
        # Managed tensors; those updated since the last step(); their post-accumulate-grad hooks.
        self._managed = {}
        self._updated = {}
        self._hooked = {}
        # Managed tensor -> squared L2 norm of the gradient of its update in the last step (0 if none,
        # inf if the update was skipped).
        self._grad_norm_sq = {}
        # Managed tensor -> number of its updates skipped for a non-finite or too large gradient.
        self._skipped = {}
        # Managed tensors updated by the Triton epilogue since the last step().
        self._updated_in_backward = {}
        # (parameter group index, device) -> (hyperparameters, [5] float64 tensor on that device) that the
        # kernels read (specs.HYPERPARAMETERS); rewritten when the group's values change.
        self._hyper: dict[tuple[int, torch.device], tuple[tuple[float, ...], torch.Tensor]] = {}
        # Managed tensor -> the update attached to it.
        self._updates = {}
        # Reentrant activation checkpointing (a tensor's gradient arrives in a backward and in the backward
        # nested in it): managed tensors used by a forward without a graph since their last update; those
        # whose gradients reaching .grad wait for the end of the running backward; the backward (graph
        # task id) in which such a gradient reached .grad.
        self._without_graph = {}
        self._held = {}
        self._arrived_in = {}
        # [tensor, update, hook handle] of each managed tensor: removed when this optimizer is
        # garbage-collected (the finalizer holds the list, not the optimizer).
        self._entries: list = []
        # id -> tensor of every tensor an update of this optimizer was built for (updates name their tensor
        # by id, see _OwnedUpdate).
        self._held_by_id: dict[int, torch.Tensor] = {}
        # Tensor -> (index, group dict) in param_groups (_group_index).
        self._group_cache: dict = {}
        # Managed tensor -> weak reference to the optimizer that owned it before this one (it takes the
        # tensor back when this one is garbage-collected).
        self._previous = {}
        weakref.finalize(self, _release, self._entries, self._previous)

    def _check_managed(self, params) -> None:
        name = type(self).__name__
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{name} params must be tensors, got {type(p).__name__}")
            if p.dtype not in ops.SUPPORTED_DTYPES:
                raise TypeError(f"{name}: expert tensors must be float32, bfloat16 or float16, got {p.dtype}")
            if not ops.is_dense(p):
                raise ValueError(f"{name}: expert tensors must be dense tensors, got strides {p.stride()}")
        self._check_complete(params)

    def _check_complete(self, params, error=ValueError) -> None:
        """Refuse (``error``) expert tensors whose in-backward update would use a partial gradient: more
        than one rank, and neither sharded nor data-parallel (optim/distributed.py)."""
        distributed.check_complete(type(self).__name__, params, self.data_parallel_group, error)

    def _check_may_update(self, p: torch.Tensor) -> None:
        """The checks before a backward updates ``p`` or adds to its gradient, each raising RuntimeError
        before anything is written: not updated since step(), its gradient complete with several ranks,
        not the backward of a GradScaler-scaled loss; ValueError for an option of ``p``'s group that the
        update does not implement. Then ``p``'s group's hyperparameters as they are now are written to the
        tensor the update reads (a value set since the forward included; :meth:`_check_groups_unchanged`
        compares them at step())."""
        self._check_not_updated(p)
        self._check_complete([p], RuntimeError)
        loss_scaling.refuse(type(self).__name__)
        check_group_options(type(self).__name__, self._group_of(p), True)
        self._hyper_tensor(p)

    def _reduces_first(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient is averaged over the data-parallel group before its update."""
        return (
            self._reducer is not None and distributed.layout(p, self.data_parallel_group) == "data-parallel"
        )

    def _manage(self, params) -> None:
        """Create the state of ``params`` (already in param_groups), attach their updates (an earlier
        optimizer that owned one lets it go) and register their hooks."""
        for p in params:
            if p in self._managed:
                continue
            previous = expert_optimizer(p)
            if previous is not None and previous is not self:
                previous._let_go(p)
                self._previous[p] = weakref.ref(previous)
            self.state[p] = self._expert_state(p, self.state.get(p, {}))
            self._managed[p] = True
            self._grad_norm_sq[p] = torch.zeros((), dtype=torch.float32, device=p.device)
            self._skipped[p] = torch.zeros((), dtype=torch.int64, device=p.device)
            self._attach(p)
        self._register_hooks()

    def _expert_state(self, p: torch.Tensor, state: dict, follows: torch.dtype | None = None) -> dict:
        """The state of ``p`` for its in-backward update: ``state`` (torch.optim.AdamW's keys: from dense
        steps taken before ``p`` was known as an expert tensor, or its own before a conversion of ``p``)
        converted (``step`` a 0-dim float32 tensor on ``p``'s device, the moments on that device in
        ``moments_dtype``, else their own dtype, else, for a dtype the kernels do not take or the dtype
        ``follows`` (the parameter's before a conversion), ``p``'s), or new zeros when it has none."""
        moments = self.moments_dtype or p.dtype
        if not all(isinstance(state.get(key), torch.Tensor) for key in ("exp_avg", "exp_avg_sq")):
            return {
                "step": torch.zeros((), dtype=torch.float32, device=p.device),
                "exp_avg": torch.zeros_like(p, dtype=moments, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, dtype=moments, memory_format=torch.preserve_format),
            }
        step = state.get("step", 0.0)
        converted = {"step": torch.as_tensor(step, dtype=torch.float32).to(p.device).reshape(()).clone()}
        for key in ("exp_avg", "exp_avg_sq"):
            value = state[key]
            kept = value.dtype in ops.SUPPORTED_DTYPES and value.dtype != follows
            dtype = self.moments_dtype or (value.dtype if kept else p.dtype)
            converted[key] = torch.empty_like(p, dtype=dtype).copy_(value)
        return converted

    def claim(self, p: torch.Tensor) -> None:
        """``p`` is an expert tensor that its experts module is about to run (called at each eager forward
        by :func:`sonar_kernels.optim.ownership.claim_expert_tensors`): when this optimizer updates it in
        the backward, rebuild its update if ``p`` was converted since (another dtype or device: its state
        follows, as if the optimizer had been built after the conversion when no update has run yet); when
        it holds ``p`` as a dense parameter (SonarAdamW), adopt it.

        Raises:
            RuntimeError: ``p`` was converted, or has a gradient of a dense backward, between a backward
                and ``step()``.
            ValueError, TypeError: ``p``'s parameter group sets an option the update does not implement,
                or ``p`` is not a tensor the update takes (see :meth:`_check_managed`).
        """
        if p in self._managed:
            update = self._updates.get(p)
            if update is not None and specs.update_of(p) is update and update.signature == signature(p):
                return
            self._rebuild(p)
            return
        if specs.update_of(p) is not None or not getattr(self, "adopts_expert_tensors", False):
            return
        if not any(q is p for group in self.param_groups for q in group["params"]):
            return  # a copy of a tensor it holds (a deep-copied model)
        name = type(self).__name__
        if p.grad is not None:
            raise RuntimeError(
                f"{name}: the expert tensor of shape {tuple(p.shape)} has a gradient from a backward in which it "
                'was trained as a dense parameter (before its experts module ran "sonar"); call step() or '
                'zero_grad() before the first forward of the "sonar" experts'
            )
        check_group_options(name, self._group_of(p), True)
        self._check_managed([p])
        self._manage([p])

    def _rebuild(self, p: torch.Tensor) -> None:
        """The update of managed ``p`` after a conversion of ``p`` (``module.to(...)``: its dtype or device
        changed, in place or by torch.utils.swap_tensors, which also drops the attached update): the state
        moves to ``p``'s device, the moments that had the parameter's dtype take its new one, and a state
        that no update has advanced yet starts anew (what building the optimizer after the conversion
        gives)."""
        name = type(self).__name__
        if p in self._updated or p in self._micro or p.grad is not None:
            raise RuntimeError(
                f"{name}: the expert tensor of shape {tuple(p.shape)} was converted (dtype or device) between a "
                "backward and step(); convert the model before its forward or after step()"
            )
        state = self.state[p]
        update = self._updates.get(p)
        fresh = float(state["step"]) == 0.0  # reads the device: a conversion is rare
        before = update.signature[0] if update is not None else p.dtype
        self.state[p] = self._expert_state(p, {} if fresh else state, follows=before)
        self._grad_norm_sq[p] = self._grad_norm_sq[p].to(p.device)
        self._skipped[p] = self._skipped[p].to(p.device)
        self._attach(p)

    def _attach(self, p: torch.Tensor) -> None:
        """(Re)build the update of ``p`` from its current state tensors and attach it."""
        state = self.state[p]
        foreach, fused = self._torch_adamw_flags(self._group_of(p), p)
        update = _OwnedUpdate(
            self, p, exp_avg=state["exp_avg"], exp_avg_sq=state["exp_avg_sq"], step=state["step"],
            hyper=self._hyper_tensor(p), grad_norm_sq=self._grad_norm_sq[p], skipped=self._skipped[p],
            grad_dtype=self.grad_dtype or p.dtype, fused=self.fused_epilogue, foreach=foreach, torch_fused=fused,
            accumulation_steps=self.accumulation_steps, reduce_first=self._reduces_first(p),
        )  # fmt: skip
        old = self._updates.get(p)
        self._updates[p] = update
        self._held_by_id[id(p)] = p
        specs.attach_update(p, update)
        for entry in self._entries:
            if entry[1] is old and entry[0] is p:
                entry[1] = update
                break
        else:
            self._entries.append([p, update, None])

    def _let_go(self, p: torch.Tensor) -> None:
        """A newer optimizer owns ``p`` now: remove this one's hook; ``p`` is no longer updated here in the
        backward (its state is kept)."""
        handle = self._hooked.pop(p, None)
        if handle is not None:
            handle.remove()
        self._managed.pop(p, None)
        self._updates.pop(p, None)
        self._entries[:] = [entry for entry in self._entries if entry[0] is not p]

    def _take_back(self, p: torch.Tensor) -> None:
        """The newer optimizer that took ``p`` was garbage-collected: own it again, with the state kept."""
        if p in self.state and any(q is p for group in self.param_groups for q in group["params"]):
            self._managed[p] = True
            self._attach(p)
            self._register_hooks()

    def _register_hooks(self) -> None:
        """The update of gradients that reach a managed tensor's ``.grad``. A hook needs requires_grad:
        tensors frozen now get theirs at the next step()."""
        this = weakref.ref(self)
        for entry in self._entries:
            p = entry[0]
            if p.requires_grad and p not in self._hooked:
                entry[2] = self._hooked[p] = p.register_post_accumulate_grad_hook(
                    _apply_accumulated_grad(this)
                )

    def _group_of(self, p: torch.Tensor) -> dict:
        return self.param_groups[self._group_index(p)]

    def _group_index(self, p: torch.Tensor) -> int:
        """The index of ``p``'s group in ``param_groups``; remembered per tensor with its group dict (each
        update asks it), looked up again when that dict is no longer at the index (``load_state_dict``)."""
        cached = self._group_cache.get(p)
        if (
            cached is not None
            and cached[0] < len(self.param_groups)
            and self.param_groups[cached[0]] is cached[1]
        ):
            return cached[0]
        for index, group in enumerate(self.param_groups):
            if any(q is p for q in group["params"]):
                self._group_cache[p] = (index, group)
                return index
        raise RuntimeError(f"{type(self).__name__}: tensor not found in param_groups")

    def _hyperparameters(self, group: dict) -> tuple[float, float, float, float, float]:
        """(lr, beta1, beta2, eps, weight_decay) of ``group`` as Python floats, as torch.optim.AdamW reads them."""
        beta1, beta2 = group["betas"]
        return (
            as_float(group["lr"], "lr"),
            as_float(beta1, "beta1"),
            as_float(beta2, "beta2"),
            as_float(group["eps"], "eps"),
            as_float(group["weight_decay"], "weight_decay"),
        )

    def _torch_hyperparameters(self, group: dict) -> tuple:
        """(lr, beta1, beta2, eps, weight_decay) of ``group`` as torch.optim.AdamW.step passes them to torch's
        AdamW: as the group holds them (Python floats or one-element tensors), so that torch's AdamW applied
        to a managed tensor (the torch backend, a gradient that reached ``.grad``) uses its arithmetic for
        tensor values, as standard training does."""
        beta1, beta2 = group["betas"]
        return (group["lr"], beta1, beta2, group["eps"], group["weight_decay"])

    def _hyper_tensor(self, p: torch.Tensor) -> torch.Tensor:
        """The [5] float64 tensor on ``p``'s device holding its group's hyperparameters, which the kernels
        read. Called when an update of ``p`` is about to run (:meth:`_check_may_update`, also inside a
        compiled backward); written again only when the group's values changed since (``group[key] = ...``,
        ``group.update``, a tensor lr filled in place by an LR scheduler).

        The tensor is saved by each forward that uses the group's expert tensors, and the backward of
        the first layer rewrites it before the later layers' backward unpacks it: the write keeps its
        version counter, so that autograd does not take it for a modified saved tensor (it is read, never
        differentiated)."""
        index = self._group_index(p)
        values = self._hyperparameters(self.param_groups[index])
        ops.check_hyperparameters(values[0], values[1:3], values[3], values[4])
        key = (index, p.device)
        cached = self._hyper.get(key)
        if cached is None or cached[0] != values:
            tensor = cached[1] if cached is not None else torch.empty(5, dtype=torch.float64, device=p.device)
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tensor):
                tensor.copy_(torch.tensor(values, dtype=torch.float64))
            self._hyper[key] = (values, tensor)
            return tensor
        return cached[1]

    def _check_not_updated(self, p: torch.Tensor) -> None:
        if p in self._updated:
            raise RuntimeError(
                f"{type(self).__name__}: the expert tensor of shape {tuple(p.shape)} was already updated in a backward "
                "since the last optimizer.step() (also when that backward raised afterwards: the update had run); "
                "call step() between backward passes (the update is applied in the backward, so another backward "
                "would update it twice), or set accumulation_steps to the number of micro-batches per step"
            )

    def _check_no_user_hooks(self, p: torch.Tensor) -> None:
        """Raise when a hook of the user's is registered on ``p``: a gradient hook (``register_hook``) or
        a post-accumulate-grad hook would never see the gradient the update uses. The library's own hook
        and torch's memory trackers' (``torch.distributed._tools``, which only read sizes) are not."""
        hooks = [
            *(getattr(p, "_backward_hooks", None) or {}).values(),
            *(getattr(p, "_post_accumulate_grad_hooks", None) or {}).values(),
        ]
        if any(not getattr(hook, "__module__", "").startswith(_KNOWN_HOOK_MODULES) for hook in hooks):
            raise RuntimeError(
                f"{type(self).__name__}: the expert tensor of shape {tuple(p.shape)} has a gradient hook of its own "
                "(register_hook or register_post_accumulate_grad_hook), which the in-backward update would bypass: "
                "its gradient never reaches a tensor or .grad; nothing was updated. Remove the hook, or give the "
                "tensor to torch.optim.AdamW"
            )

    def _check_groups_unchanged(self) -> None:
        """Raise before ``step()`` does anything (RuntimeError; the step is not ended, so it raises again
        until the value is set back) when a hyperparameter of a group whose expert tensors were updated in
        this step's backward changed since that update, however it was set (``group[key] = ...``,
        ``group.update``, a tensor lr filled in place): the update used the old value, and the dense
        step would use the new one. ValueError when a group holding expert tensors sets an option the
        update does not implement."""
        name = type(self).__name__
        for index, group in enumerate(self.param_groups):
            managed = [p for p in group["params"] if p in self._managed]
            if not managed:
                continue
            check_group_options(name, group, True)
            keys = {(index, p.device) for p in managed if p in self._updated} & self._hyper.keys()
            if not keys:
                continue
            values = self._hyperparameters(group)
            for before in {self._hyper[key][0] for key in keys}:
                changed = [
                    (key, old, new)
                    for key, old, new in zip(specs.HYPERPARAMETERS, before, values, strict=True)
                    if old != new
                ]
                if changed:
                    details = ", ".join(f"{key} {old!r} -> {new!r}" for key, old, new in changed)
                    raise RuntimeError(
                        f"{name}: {changed[0][0]} of parameter group {index} changed after its expert tensors were "
                        f"updated in this step's backward and before step() ({details}): their update already "
                        "used the old value, where torch.optim.AdamW takes the new one in this step (as this step() "
                        "would for the dense parameters); nothing was changed. Set the value back and call step(); "
                        "set hyperparameters after optimizer.step() (an LR scheduler's step() after the optimizer's, "
                        "as torch documents) or before the backward"
                    )

    def _accumulating(self, p: torch.Tensor) -> bool:
        """Whether this backward's gradient of ``p`` goes into ``p.grad`` (micro-batches 1 .. k-1 of
        ``accumulation_steps`` = k) instead of into an update; raises if ``p`` was updated since step()."""
        self._check_not_updated(p)
        return self._micro.get(p, 0) + 1 < self.accumulation_steps

    def _uses_buffer(self, p: torch.Tensor) -> bool:
        """Whether micro-batch gradients of ``p`` are summed in a buffer of ``grad_dtype`` rather than in
        ``p.grad`` (which has ``p``'s dtype)."""
        return (self.grad_dtype or p.dtype) != p.dtype

    def _accumulator_for(self, p: torch.Tensor) -> ops.GradAccumulator | None:
        """Where the Triton backward adds this micro-batch's gradient of ``p`` (not the last of the
        window): None for ``p.grad`` (autograd sums it), else the buffer of ``grad_dtype``. A new buffer
        (the window's first micro-batch) is kept only once its launch is done, so a backward that fails
        before leaves nothing unwritten behind."""
        if not self._uses_buffer(p):
            return None
        buffer = self._buffers.get(p)
        add = buffer is not None
        if buffer is None:
            buffer = like(p, self.grad_dtype)
        return ops.GradAccumulator(buffer, add)

    def _accumulated_into(self, p: torch.Tensor, buffer: torch.Tensor) -> None:
        self._buffers[p] = buffer
        self._count_micro_batch(p)
        if p in self._held:
            self._held[p] = True  # this backward's micro-batch is counted

    def _count_micro_batch(self, p: torch.Tensor) -> int:
        count = self._micro.get(p, 0) + 1
        self._micro[p] = count
        return count

    def _grad_in(self, p: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor | None:
        """The gradient of earlier micro-batches of ``p`` (its buffer or ``.grad``) plus ``other`` (what
        the tensor's other producers gave in this backward), in ``grad_dtype`` with ``p``'s strides, which
        the backward's update adds to its own; None when there is none."""
        grad_dtype = self.grad_dtype or p.dtype
        grad_in = self._buffers.get(p, p.grad)
        if grad_in is not p.grad and p.grad is not None:
            # A buffer, and a part held in .grad (reentrant checkpointing, see _hold_until_backward_ends).
            other = p.grad if other is None else other + p.grad
        if other is not None:
            with torch.no_grad():
                grad_in = other if grad_in is None else grad_in + other
        if grad_in is not None and (grad_in.dtype != grad_dtype or grad_in.stride() != p.stride()):
            grad_in = torch.empty_like(p, dtype=grad_dtype).copy_(grad_in)
        return grad_in

    def _finish_update(self, p: torch.Tensor) -> None:
        """After the kernels wrote p and its moments: record it, and bump the version counters (Triton
        writes do not), so a graph that saved the old p fails loudly instead of using new values."""
        self._updated[p] = True
        self._updated_in_backward[p] = True
        self._micro.pop(p, None)
        self._without_graph.pop(p, None)
        p.grad = None  # the accumulated gradient, consumed by the update
        self._buffers.pop(p, None)
        state = self.state[p]
        torch.autograd.graph.increment_version([p, state["exp_avg"], state["exp_avg_sq"]])

    def _apply_grad(self, p: torch.Tensor) -> None:
        """torch's own AdamW on an accumulated ``p.grad``, which is then released (torch backend).

        Skipped, as the Triton update is (see ops.AdamWUpdate), when the gradient has an entry that is
        not finite or beyond ops.grad_limit: with fused=True through torch's ``found_inf`` (no host
        sync); torch's other AdamW paths have no such input, so the decision is read on the host there
        (a sync on a GPU).
        """
        self._check_not_updated(p)
        grad = self._buffers.get(p, p.grad)
        group = self._group_of(p)
        foreach, fused = self._torch_adamw_flags(group, p)
        state = self.state[p]
        ops.torch_adamw_(
            p, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], self._torch_hyperparameters(group),
            self._grad_norm_sq[p], self._skipped[p], foreach=foreach, fused=fused,
        )  # fmt: skip
        p.grad = None
        self._buffers.pop(p, None)
        self._updated[p] = True
        self._micro.pop(p, None)

    def _hold_until_backward_ends(self, p: torch.Tensor) -> None:
        """Gradients of ``p`` that reach ``.grad`` from now on wait for the end of the running backward
        (they arrive in it and in backwards nested in it), where they count as one micro-batch, or join
        the one the MLP's backward counted (``_held[p]`` True: it added to the buffer) or consumed (its
        update read ``.grad``)."""
        if p not in self._held:
            self._held[p] = False
            torch.autograd.Variable._execution_engine.queue_callback(_weak_call(self, "_release_held", p))

    def _release_held(self, p: torch.Tensor) -> None:
        counted = self._held.pop(p, False)
        self._arrived_in.pop(p, None)
        if p.grad is None:
            return
        if counted:
            with torch.no_grad():
                self._buffers[p].add_(p.grad)
            p.grad = None
        else:
            self._on_grad_accumulated(p)

    def _on_grad_accumulated(self, p: torch.Tensor) -> None:
        """A gradient was added to ``p.grad`` (torch backend, or a micro-batch before the last): keep it
        until the k-th micro-batch, then apply torch's AdamW and release it.

        After a forward without a graph (reentrant activation checkpointing), the part of this backward
        waits for its end: the checkpointed region's backward, nested in this one, may add the MLP's part
        (its update then reads ``.grad``)."""
        if p in self._held:
            return
        if p in self._without_graph and torch._C._current_graph_task_id() != -1:
            self._arrived_in[p] = torch._C._current_graph_task_id()
            self._hold_until_backward_ends(p)
            return
        if p in self._updated and self._updated_in_backward.get(p, False):
            raise RuntimeError(
                f"{type(self).__name__}: the expert tensor of shape {tuple(p.shape)} received a gradient from "
                "outside the expert MLP (e.g. a penalty on the weights) after the MLP's backward updated it; a "
                "tensor updated in the backward must get its whole gradient from moe_mlp / SonarExperts"
            )
        self._check_may_update(p)
        if self._uses_buffer(p):
            buffer = self._buffers.get(p)
            with torch.no_grad():
                if buffer is None:
                    self._buffers[p] = like(p, self.grad_dtype).copy_(p.grad)
                else:
                    buffer.add_(p.grad)
            p.grad = None
        if self._count_micro_batch(p) >= self.accumulation_steps:
            if self._reduces_first(p):
                # Averaged over the data-parallel group while the backward goes on; updated when done.
                self._reducer.reduce(self._buffers.get(p, p.grad), _weak_call(self, "_apply_grad", p))
            else:
                self._apply_grad(p)

    @property
    def expert_tensors(self) -> list[torch.Tensor]:
        """The tensors this optimizer updates in the backward (it owns them), in param_groups order."""
        return [p for group in self.param_groups for p in group["params"] if p in self._managed]

    def expert_grad_norm(self, params=None) -> torch.Tensor:
        """L2 norm of the expert gradients of the current step (read it after the backward, or after
        ``step()``, until the next step's backward writes new values): a 0-dim float32 tensor on the
        tensors' device, summed in param_groups order from per-tensor squared norms that the wgrad
        kernels sum deterministically. A tensor that got no gradient in that step counts as 0; one whose
        update was skipped (see :meth:`expert_skipped_updates`) as inf. Reading it (``float()``) syncs
        with the device.

        With several ranks it is the norm of the whole model's expert gradients, the same on every rank:
        expert-parallel tensors (each rank holds other experts) add their squared norms over their
        expert-parallel group (a collective: call it on every rank); data-parallel ones are averaged
        before their update and sharded ones (FSDP2) are reduced over their mesh already.

        Args:
            params: the expert tensors to include (e.g. one layer's ``SonarExperts.parameters()``); None:
                all of this optimizer's expert tensors.
        Raises:
            ValueError: a tensor this optimizer does not update in the backward.
        """
        return distributed.sum_over_expert_parallel_groups(
            self._grad_norm_sq, self._ordered(params), torch.float32
        ).sqrt()

    def expert_skipped_updates(self, params=None) -> torch.Tensor:
        """How many in-backward updates were skipped because the gradient had an entry that was NaN,
        infinite, or beyond ``sonar_kernels.ops.grad_limit`` (the update is then not applied at all:
        weights, moments and step stay as they were; see ``ops.AdamWUpdate``). Counted on the device
        since this optimizer was built (not saved in ``state_dict()``): a 0-dim int64 tensor, summed over
        ``params`` (None: all expert tensors of this optimizer). Reading it syncs with the device.

        Raises:
            ValueError: a tensor this optimizer does not update in the backward.
        """
        return self._sum_in_order(self._skipped, params, torch.int64)

    def _ordered(self, params) -> list[torch.Tensor]:
        """``params`` (None: all managed tensors) in param_groups order.

        Raises:
            ValueError: a tensor this optimizer does not update in the backward.
        """
        chosen = None if params is None else list(params)
        if chosen is not None:
            for p in chosen:
                if p not in self._managed:
                    raise ValueError(
                        f"a tensor of shape {tuple(p.shape)} is not an expert tensor of this optimizer"
                    )
        ordered = self.expert_tensors
        if chosen is not None:
            ordered = [p for p in ordered if any(p is q for q in chosen)]
        return ordered

    def _sum_in_order(self, values, params, dtype: torch.dtype) -> torch.Tensor:
        """The per-tensor 0-dim ``values`` of ``params`` (None: all managed tensors), added in
        param_groups order on the first one's device (a 0-dim CPU zero of ``dtype`` when there are none).

        Raises:
            ValueError: a tensor this optimizer does not update in the backward.
        """
        ordered = self._ordered(params)
        if not ordered:
            return torch.zeros((), dtype=dtype)
        total = values[ordered[0]].clone()
        for p in ordered[1:]:
            total += values[p].to(total.device)
        return total

    def _torch_adamw_flags(self, group: dict, p: torch.Tensor) -> tuple[bool | None, bool | None]:
        """(foreach, fused) for torch's AdamW on managed ``p`` (the torch backend's update, a gradient that
        reaches ``.grad``): :func:`torch_adamw_flags` of its group."""
        return torch_adamw_flags(group, [p])

    @torch.compiler.disable
    def _run_closure_and_end_step(self, closure):
        """Check the groups (:meth:`_check_groups_unchanged`), run ``closure`` (with grad enabled, as
        torch.optim does) if given, then :meth:`_end_step`, also when the closure raises. Returns the
        closure's loss or None.

        Eager also under ``torch.compile(optimizer.step)`` (torch's compiled-optimizer recipe): per-tensor
        bookkeeping and hooks, no tensor math to compile (a closure runs eagerly there)."""
        self._check_groups_unchanged()
        try:
            if closure is None:
                return None
            with torch.enable_grad():
                return closure()
        finally:
            self._end_step()

    def _end_step(self) -> None:
        """Apply once a gradient found on a managed tensor (it had requires_grad=False when it was given,
        so its hook came later), then end the step: each managed tensor may be updated again."""
        try:
            if self._reducer is not None:
                self._reducer.drain()  # reductions left by a backward that raised
            for p in list(self._managed.keys()):
                if p.grad is not None and p in self._updated:
                    # Left by a backward that already raised (one more than accumulation_steps).
                    p.grad = None
                elif p.grad is not None or p in self._buffers:
                    if self._reduces_first(p):
                        self._reducer.reduce(
                            self._buffers.get(p, p.grad),
                            _weak_call(self, "_apply_grad", p),
                            in_backward=False,
                        )
                    else:
                        self._apply_grad(p)
            for p in list(self._managed.keys()):
                if p not in self._updated:
                    self._grad_norm_sq[p].zero_()  # no gradient this step: it counts as 0
        finally:
            # The step ends even when a gradient above was refused (a tensor updated twice).
            self._updated = {}
            self._updated_in_backward = {}
            self._micro = {}
            self._buffers = {}
            self._register_hooks()

    def __deepcopy__(self, memo):
        raise TypeError(
            f"{type(self).__name__} cannot be copied: it owns the in-backward updates of its expert tensors "
            "(one owner per tensor); copy optimizer.state_dict() and load it into a new optimizer"
        )

    def __reduce_ex__(self, protocol):
        raise TypeError(
            f"{type(self).__name__} cannot be pickled: save optimizer.state_dict() (torch.save) and load it into "
            "a new optimizer"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch.optim.Optimizer.zero_grad, and it starts a new gradient-accumulation window: the
        micro-batches counted towards ``accumulation_steps`` are forgotten with their gradient (the
        buffers of ``grad_dtype`` are released, or zeroed with ``set_to_none=False``, like ``.grad``)."""
        super().zero_grad(set_to_none)
        self._micro = {}
        if set_to_none:
            self._buffers = {}
        else:
            for buffer in self._buffers.values():
                buffer.zero_()

    def state_dict(self) -> dict:
        """As torch.optim.Optimizer.state_dict, with the ``step`` of the tensors updated in the backward
        as a CPU tensor (a copy; the live one stays on the device), as torch.optim.AdamW keeps it outside
        its fused and capturable modes: loaded into a non-fused torch.optim.AdamW it then does not read a
        device scalar on the host at every step. Reading it syncs with the device (checkpoint time)."""
        saved = super().state_dict()
        ids = [i for group in saved["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for param_id, p in zip(ids, params, strict=True):
            state = saved["state"].get(param_id)
            if p in self._managed and state is not None and isinstance(state.get("step"), torch.Tensor):
                saved["state"][param_id] = {**state, "step": state["step"].to("cpu", copy=True)}
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch.optim.Optimizer.load_state_dict (a torch.optim.AdamW state_dict loads too), except for
        the tensors updated in the backward: their exp_avg and exp_avg_sq keep the dtype they were saved
        with (torch casts them to the parameter's dtype), or become ``moments_dtype`` when it was given;
        their ``step`` becomes a float32 tensor on the parameter's device (the kernels read it there).

        Raises:
            ValueError: a group holding expert tensors with amsgrad, maximize, capturable, differentiable,
                or non-decoupled weight decay (Adam), which the in-backward update does not implement, or
                hyperparameters outside their ranges (groups of dense parameters only load whatever
                torch.optim.AdamW loads); another number of groups; a parameter state without moments, or
                moments whose shape is not the parameter's.
            RuntimeError: called after a backward that updated expert tensors and before ``step()``.
        """
        if any(p in self._managed for p in self._updated):
            raise RuntimeError(
                f"{type(self).__name__}: load_state_dict() after a backward that updated expert tensors and before "
                "step(): the weights already hold this step's update, and the loaded moments and step would not "
                "match them; call step() (or load before the forward)"
            )
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")  # torch's words
        # A group that holds expert tensors: only the options and ranges the in-backward update implements;
        # any other group loads as into torch.optim.AdamW.
        for group, own in zip(saved_groups, self.param_groups, strict=True):
            if any(p in self._managed for p in own["params"]):
                check_group_options(f"{type(self).__name__}.load_state_dict", group, True)
                ops.check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        ids = [i for g in saved_groups for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        if len(ids) != len(params):
            raise ValueError(f"the state_dict holds {len(ids)} parameters, this optimizer {len(params)}")
        for param_id, p in zip(ids, params, strict=True):
            saved = saved_state.get(param_id, {})
            if p not in self._managed:
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                value = saved.get(key)
                if saved and not isinstance(value, torch.Tensor):
                    raise ValueError(f"the state of parameter {param_id} has no {key} tensor")
                if isinstance(value, torch.Tensor) and value.shape != p.shape:
                    raise ValueError(
                        f"{key} of parameter {param_id} has shape {tuple(value.shape)}, the parameter {tuple(p.shape)}"
                    )
        super().load_state_dict(state_dict)
        # torch's load_state_dict builds new group dicts: new hyperparameter tensors below (_attach).
        self._hyper = {}
        # The managed tensors' state: what the kernels read (torch's policy is kept for the others).
        for param_id, p in zip(ids, params, strict=True):
            if p not in self._managed:
                continue
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
            # The update reads the new state tensors.
            self._attach(p)


# Modules whose hooks on an expert tensor are known not to need its gradient: this library's, and torch's
# memory trackers (MemTracker).
_KNOWN_HOOK_MODULES = (__name__, "torch.distributed._tools.")


def _weak_call(obj, method: str, *bound):
    """A callable that calls ``obj.<method>(*bound, *args)`` while ``obj`` lives, holding it weakly."""
    ref = weakref.ref(obj)

    def call(*args):
        target = ref()
        if target is not None:
            getattr(target, method)(*bound, *args)

    return call


def _apply_accumulated_grad(optimizer_ref):
    def hook(p: torch.Tensor) -> None:
        optimizer = optimizer_ref()
        if optimizer is not None and p.grad is not None:
            optimizer._on_grad_accumulated(p)

    # The hook outlives the tensor's attributes (torch.utils.swap_tensors swaps them away, not the hooks):
    # ownership.owner_of finds the owner through it.
    hook.sonar_optimizer = optimizer_ref
    return hook


def signature(t: torch.Tensor) -> tuple:
    """(dtype, device, shape) of ``t``: what a module conversion (``module.to(...)``) changes."""
    return (t.dtype, t.device, tuple(t.shape))
