"""The expert MLP's autograd formula over the ``sonar_kernels::`` custom ops (docs/design.md, "Backward and
the fused update").

The forward is the op ``sonar_kernels::moe_mlp_fwd``; its registered backward calls
``sonar_kernels::moe_mlp_bwd`` (what the layer computes once) and, per expert tensor,
``sonar_kernels::expert_wgrad`` (its gradient) or ``sonar_kernels::expert_wgrad_`` (its in-backward
update, or its gradient added to a buffer). In plain eager mode (:func:`plain_eager`) the same body and
formula run as the autograd.Function :class:`EagerMoeMlp`, without the ops' dispatch. A weight whose
tensor carries an in-backward update (:func:`sonar_kernels.specs.update_of`, attached by the optimizer
that owns it) is updated inside that backward and gets no gradient; in eager mode the update of a leaf
weight waits in the pre-hook of its AccumulateGrad node until the engine has every part of its gradient
(docs/design.md, "When the updates run"). Every other weight gets its gradient, and so does an owned one
whose gradient ``torch.autograd.grad`` returns to its caller (no update then). The update's tensors are
inputs of the forward op, so torch.compile sees them and the whole step compiles (``fullgraph=True``);
the owner's host-side checks run in eager mode only.

The public seam for ``autograd/moe_mlp.py``: :func:`apply`.
"""

from __future__ import annotations

import functools
import weakref

import torch

from sonar_kernels import specs
from sonar_kernels.ops import library
from sonar_kernels.update_state import UpdateState, kind_of

# The forward op's inputs (library.moe_mlp_fwd): the expert tensors (specs.EXPERT_TENSORS order) are
# inputs 3 to 7; then the options and, per expert tensor, its update's state, hyperparameters and gradient
# dtype.
_FIRST_EXPERT = 3
_WEIGHTS = tuple((_FIRST_EXPERT + i, name) for i, name in enumerate(specs.EXPERT_TENSORS))
_STATES, _STATE_SIZES, _HYPERS, _GRAD_DTYPES = 11, 12, 13, 14
_NUM_INPUTS = 18
# The order of the expert tensors' gradient jobs in the backward: the down projection's first (its
# operand A is released then), the gate/up projection's last.
_JOB_ORDER = ("down_proj_bias", "down_proj", "gate_up_proj_bias", "gate_up_proj", "up_proj")


def update_for(weight: torch.Tensor) -> specs.ExpertUpdate | None:
    """The update of ``weight`` when this forward records a graph that computes its gradient."""
    update = specs.update_of(weight)
    if update is None or not weight.requires_grad:
        return None
    if update.reduce_first:
        return None  # an ordinary gradient, reduced over the data-parallel group before the update
    if not torch.is_grad_enabled():
        if not torch.compiler.is_compiling():
            update.forward_without_graph()
        return None
    if torch.compiler.is_compiling() and update.accumulation_steps > 1:
        raise RuntimeError(
            "gradient accumulation (accumulation_steps > 1) of in-backward updates runs in eager mode only; "
            "under torch.compile use accumulation_steps=1"
        )
    return update


def _setup_context(ctx, inputs, output) -> None:
    hidden_states, top_k_weights = inputs[0], inputs[2]
    tensors = list(inputs[_FIRST_EXPERT : _FIRST_EXPERT + len(_WEIGHTS)])
    flat, sizes, hypers = inputs[_STATES], inputs[_STATE_SIZES], inputs[_HYPERS]
    states = _split(flat, sizes)
    ctx.activation, ctx.backend, ctx.layout = inputs[8:11]
    _, hpre, *meta = output
    # Only the layer's output carries a gradient: hpre and the routing metadata are saved, never used
    # downstream, so autograd would otherwise fill a zero gradient of each ([S, 2I] for hpre) for the
    # backward to ignore.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(hidden_states, top_k_weights, *tensors, hpre, *meta, *hypers, *flat)
    ctx.state_sizes = tuple(sizes)
    ctx.grad_dtypes = tuple(library.grad_dtype_of(code) for code in inputs[_GRAD_DTYPES])
    ctx.options = tuple(inputs[_GRAD_DTYPES + 1 :])  # fused_epilogue, foreach, torch_fused
    # The owners' bookkeeping, in eager mode (under torch.compile the inputs are functional tensors,
    # without attributes): read from the tensors passed in now (saved tensors may come back as other
    # objects, e.g. under activation checkpointing).
    ctx.owners = ctx.watched = (None,) * len(_WEIGHTS)
    if not torch.compiler.is_compiling():
        ctx.owners = tuple(
            specs.update_of(t) if state else None for t, state in zip(tensors, states, strict=True)
        )
        # Per owned tensor: its gradient edge (whether a backward asks for its gradient) and the version
        # of the tensor this forward saw (whether it changed before the backward). The hyperparameters are
        # read when the backward runs (the owner rewrites their tensor then, keeping its version).
        ctx.watched = tuple(
            None if owner is None else _Watched(t) for owner, t in zip(ctx.owners, tensors, strict=True)
        )
        for owner in ctx.owners:
            if owner is not None:
                owner.track(ctx)


def _split(flat, sizes) -> list:
    """``flat`` cut into consecutive pieces of ``sizes`` (the forward's per-tensor update states)."""
    pieces, start = [], 0
    for size in sizes:
        pieces.append(list(flat[start : start + size]))
        start += size
    return pieces


class _Watched:
    """What the backward checks of an owned weight before it unpacks anything (eager mode)."""

    def __init__(self, weight: torch.Tensor):
        self.weight, self.weight_version = weakref.ref(weight), weight._version
        self.outer_task = None  # see outer_task_accumulating

    def request(self, node) -> tuple[object, str]:
        """(the weight's AccumulateGrad node or None, what the running backward does with its gradient:
        "accumulate", "capture" or "none"; see :func:`sonar_kernels.ops.library.gradient_request`),
        read at ``node`` (this op's backward node)."""
        return library.gradient_request(node, self.weight())

    def check_unchanged(self) -> None:
        """Raise the library's error (before autograd's own, which names no cause) when the weight changed
        since the forward."""
        weight = self.weight()
        if weight is not None and weight._version != self.weight_version:
            raise RuntimeError(
                f"an expert tensor of shape {tuple(weight.shape)} changed after the forward of this graph "
                "(its in-backward update already ran, in an earlier backward of this graph with "
                "retain_graph=True, or it was modified in place): an in-backward update runs once per "
                "forward, from the weights that forward used; run the forward again for another backward"
            )


def outer_task_accumulating(weight: torch.Tensor, owner: specs.ExpertUpdate) -> int | None:
    """Called for a forward that runs inside a backward (the recomputation of reentrant activation
    checkpointing; its graph's backward runs nested in the running one): the id of the running backward
    when it also delivers a part of the leaf ``weight``'s gradient (a penalty on the weights outside the
    checkpointed region) that has not reached the weight yet; else None. The update then waits for that
    backward's AccumulateGrad node, where the gradient is complete; a part that already arrived waits in
    ``.grad``, where the update reads it."""
    accumulates = False
    if weight.is_leaf:
        try:
            node = torch.autograd.graph.get_gradient_edge(weight).node
            accumulates = torch._C._will_engine_execute_node(node)
        except RuntimeError:  # the running backward is torch.autograd.grad, which accumulates nothing
            pass
    arrived = owner.forward_in_backward(accumulates)
    return torch._C._current_graph_task_id() if accumulates and not arrived else None


def _backward(ctx, grad_out, *unused):
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        # create_graph=True: the backward would have to record a graph of itself (and of the in-backward
        # update); the expert MLP is differentiable once. Refused before anything is computed or written.
        raise RuntimeError(
            "moe_mlp is differentiable once: its backward cannot be differentiated (create_graph=True, "
            "double backward); compute higher-order gradients without the sonar experts"
        )
    needs = list(ctx.needs_input_grad)
    # Eager mode, owned weights: checks that raise the library's own errors before any saved tensor is
    # unpacked (autograd's version check would fail first) and before anything is written; a weight whose
    # gradient this backward does not compute (torch.autograd.grad of other inputs) is neither updated nor
    # given a gradient.
    # torch.autograd.grad that returns a weight's gradient to the caller: the gradient, no update
    # (autograd.grad accumulates nothing, and an optimizer does not see it).
    captured = [False] * len(_WEIGHTS)
    accumulators, outer_tasks = [None] * len(_WEIGHTS), [None] * len(_WEIGHTS)
    for i, ((index, _), watched, owner) in enumerate(zip(_WEIGHTS, ctx.watched, ctx.owners, strict=True)):
        if watched is not None and needs[index]:
            watched.check_unchanged()
            outer_tasks[i] = watched.outer_task
            accumulators[i], request = watched.request(ctx)
            needs[index] = request != "none"
            captured[i] = request == "capture"
            if request != "accumulate":
                owner.untrack(ctx)
    count = len(_WEIGHTS)
    hidden_states, top_k_weights, *rest = ctx.saved_tensors
    if grad_out is None:  # no gradient reached the output (grads are not materialized: _setup_context)
        grad_out = torch.zeros_like(hidden_states)
    weights, (hpre, *meta) = list(rest[:count]), rest[count : count + 6]
    hypers, states = list(rest[count + 6 : 2 * count + 6]), _split(rest[2 * count + 6 :], ctx.state_sizes)
    # Eager mode with owners: the update writes the parameter and its owner's state and reads the owner's
    # hyperparameters (rewritten by begin_backward below), never what saved-tensor hooks gave back
    # (torch.autograd.graph.save_on_cpu returns copies on CUDA).
    for i, (watched, owner) in enumerate(zip(ctx.watched, ctx.owners, strict=True)):
        if owner is not None and watched.weight() is not None:
            weights[i], states[i], hypers[i] = watched.weight(), owner.state(), owner.hyper
    fused_epilogue, foreach, torch_fused = ctx.options
    backend, layout = ctx.backend, ctx.layout
    triton = backend == "triton"
    # Per expert tensor: whether its gradient is computed, what the backward does with it, and the buffer
    # it reads or adds to.
    # Eager mode with owners: a leaf weight's update waits for its whole gradient. It runs in the pre-hook
    # of the weight's AccumulateGrad node, which the engine runs once every other producer of that
    # gradient (a penalty on the weights, another use of the tensor) has delivered its part, with those
    # parts added to the update's grad_in; nothing reaches .grad. A gradient added to a buffer (mode
    # "accumulate") gets those parts added to the buffer in the same pre-hook.
    wanted = [needs[index] and weights[i] is not None for i, (index, _) in enumerate(_WEIGHTS)]
    plans, waits = [], [False] * count
    for i, ((_, name), state, hyper, owner, grad_dtype) in enumerate(
        zip(_WEIGHTS, states, hypers, ctx.owners, ctx.grad_dtypes, strict=True)
    ):
        mode, buffer, add = "grad", None, False
        if state and wanted[i] and not captured[i]:
            if owner is None:  # compiled: the update, nothing accumulated
                mode = "update"
                # Raises, before any update of this backward, when the backward does not ask for the
                # weight's gradient (torch.autograd.grad of other inputs).
                library.check_update_requested(weights[i], UpdateState.of(state).step, name)
                if weights[i].requires_grad:  # tracing: refuse other producers at compile time
                    weights[i].register_hook(functools.partial(_refuse_other_producers, name))
            else:
                # Raises before anything is written (a second update before step(), another live graph).
                owner.begin_backward(ctx)
                if owner.accumulating():
                    accumulation = owner.accumulation_buffer() if triton else None
                    if accumulation is not None:
                        mode, (buffer, add) = "accumulate", accumulation
                elif accumulators[i] is not None:
                    mode, waits[i] = "update", True
                else:
                    mode, buffer = "update", owner.grad_in()
        plans.append((mode, list(state) if mode != "grad" else [], hyper, buffer, add, grad_dtype))
    # Eager mode: every plan is checked before the first job runs (a refused update changes nothing).
    # Under torch.compile each op checks its own plan when it runs (the checks read the hyperparameters'
    # values, which a traced graph does not have).
    for i, (mode, state, hyper, buffer, add, grad_dtype) in enumerate(plans):
        if wanted[i] and mode != "grad" and not torch.compiler.is_compiling():
            library.check_expert_wgrad(
                _WEIGHTS[i][1],
                weights[i],
                mode,
                state,
                hyper,
                buffer,
                add,
                grad_dtype,
                fused_epilogue,
                backend,
                layout,
            )
    owned = any(owner is not None for owner in ctx.owners)
    # Eager mode: the jobs' bodies without the ops' dispatch (with owners, each update is reported to its
    # owner as soon as it is applied, and may wait for the weight's whole gradient: see below); under
    # torch.compile, a dispatch mode or a tensor subclass, the ops.
    direct = owned or (getattr(ctx, "eager", False) and not torch.compiler.is_compiling())
    updates = [wanted[i] and mode == "update" for i, (mode, *_) in enumerate(plans)]
    down_proj, up_proj = weights[1], weights[2]
    core_needs = [
        needs[0], needs[2], wanted[0] or wanted[2] or wanted[3], wanted[1], triton and any(updates),
    ]  # fmt: skip
    core = dict(
        grad_out=grad_out, hidden_states=hidden_states, top_k_weights=top_k_weights, gate_up_proj=weights[0],
        down_proj=down_proj, up_proj=up_proj, down_proj_bias=weights[4], hpre=hpre, meta=meta, needs=core_needs,
        activation=ctx.activation, backend=backend, layout=layout,
    )  # fmt: skip
    if direct:
        # hpre is read by no one after this backward unless the graph is kept (retain_graph=True): the torch
        # backend then writes dHpre over it.
        writable = not torch._C._autograd._get_current_graph_task_keep_graph()
        grad_x, grad_w, grad_hpre, a, magnitudes = library.run_moe_mlp_bwd(**core, hpre_writable=writable)
    else:
        outputs = library.moe_mlp_bwd(**core)
        grad_x, grad_w, grad_hpre, a, magnitudes = (
            t if need else None for t, need in zip(outputs, core_needs, strict=True)
        )
    del core
    I = specs.down_view(down_proj, layout).shape[2]
    gate, up = (
        (grad_hpre, None) if up_proj is None or grad_hpre is None else (grad_hpre[:, :I], grad_hpre[:, I:])
    )
    operands = {
        "gate_up_proj": (gate, hidden_states), "down_proj": (grad_out, a), "up_proj": (up, hidden_states),
        "gate_up_proj_bias": (grad_hpre, None), "down_proj_bias": (grad_out, None),
    }  # fmt: skip
    del a, grad_hpre, gate, up
    if owned:
        # The backward reports each weight's update (or accumulation) as soon as it is applied, so that a
        # failure further on cannot leave it unrecorded.
        done = tuple(
            functools.partial(owner.finish, mode == "update") if owner is not None and mode != "grad" else None
            for owner, (mode, *_) in zip(ctx.owners, plans, strict=True)
        )  # fmt: skip
        # The torch backend's AdamW takes the hyperparameters as the owner's group holds them: a tensor lr
        # or tensor betas get torch's arithmetic for tensors, as in standard training.
        values = tuple(
            owner.hyperparameters()
            if owner is not None and mode == "update" and not triton and kind_of(owner).moments == "exact"
            else None  # 8-bit moments read the [5] float64 tensor, as the kernels do
            for owner, (mode, *_) in zip(ctx.owners, plans, strict=True)
        )  # fmt: skip
    else:
        done = values = (None,) * count
    grads = [None] * count
    for name in _JOB_ORDER:
        i = specs.EXPERT_TENSORS.index(name)
        p, q = operands.pop(name)
        if not wanted[i]:
            continue
        mode, state, hyper, buffer, add, grad_dtype = plans[i]
        job = dict(name=name, weight=weights[i], p=p, q=q, top_k_weights=top_k_weights, meta=meta)
        del p, q
        if mode == "grad":
            if direct:
                grads[i] = library.run_expert_grad(**job, backend=backend, layout=layout)
            else:
                grads[i] = library.expert_wgrad(**job, backend=backend, layout=layout)
            continue
        if direct:
            run = functools.partial(
                library.run_expert_wgrad, **job, mode=mode, state=state, hyper=hyper, backend=backend, layout=layout,
                magnitudes=magnitudes, buffer=buffer, buffer_add=add, grad_dtype=grad_dtype,
                fused_epilogue=fused_epilogue, foreach=foreach, torch_fused=torch_fused, value=values[i],
            )  # fmt: skip
            if waits[i]:  # the whole gradient first: launched in the weight's AccumulateGrad pre-hook
                _when_complete(accumulators[i], ctx.owners[i], outer_tasks[i], run, done[i])
            else:
                run()
                if done[i] is not None:
                    done[i]()
            del run
        else:
            library.expert_wgrad_(
                **job, magnitudes=magnitudes, wgrad_mode=mode, state=state, hyper=hyper, buffer=buffer,
                buffer_add=add, grad_dtype=grad_dtype, fused_epilogue=fused_epilogue, foreach=foreach,
                torch_fused=torch_fused, backend=backend, layout=layout,
            )  # fmt: skip
        del job
    for accumulator, outer, owner, (mode, *_) in zip(
        accumulators, outer_tasks, ctx.owners, plans, strict=True
    ):
        if mode == "accumulate" and accumulator is not None:
            _on_accumulator(accumulator, owner.add_to_buffer, outer)
    # One entry per input of the forward op; a list input gets a list of Nones.
    result = [None] * _NUM_INPUTS
    result[0], result[2] = grad_x, grad_w
    for (index, _), grad in zip(_WEIGHTS, grads, strict=True):
        result[index] = grad
    result[_STATES] = [None] * sum(ctx.state_sizes)
    result[_HYPERS] = None  # a list of optional tensors is one leaf of the inputs' structure
    return tuple(result)


def _refuse_other_producers(name: str, grad) -> None:
    """A hook on a weight while torch.compile traces the backward: the MLP's backward gives the updated
    weight no gradient, so a gradient here comes from another use of the tensor inside the compiled graph
    (a penalty on the weights), which the update inside the compiled backward could not include. Raised
    at compile time, before anything runs."""
    if grad is not None:
        raise RuntimeError(
            f"{name}: another use of this expert tensor in the compiled graph (a penalty on the weights, a "
            "second use) adds to its gradient, and the update inside a compiled backward runs before that part "
            "is known; nothing was updated. Run the model without torch.compile (in eager mode the update "
            "waits for every use of the tensor), or leave the other use out"
        )


def _when_complete(accumulator, owner, outer_task, run, done) -> None:
    """In the pre-hook of ``accumulator``: ``run(buffer=grad_in)`` (the weight's wgrad and its update, their
    operands kept alive by ``run`` until then; checked again with that ``grad_in``), ``grad_in`` the
    gradient of earlier micro-batches and of the weight's other producers (see :func:`_on_accumulator`);
    then ``done()``, the update reported to its owner."""

    def whole(other):
        run(buffer=owner.grad_in(other))
        done()

    _on_accumulator(accumulator, whole, outer_task)


def _on_accumulator(accumulator, fn, outer_task: int | None = None) -> None:
    """Call ``fn(other)`` once, in the pre-hook of the AccumulateGrad node ``accumulator`` (the engine runs
    it when every producer of the weight's gradient has run), with ``other`` the sum of the gradients the
    other producers gave (None when there are none); the node then accumulates nothing.

    The node runs in the backward running now; when this backward is nested in the backward
    ``outer_task`` (reentrant activation checkpointing) that also delivers to the node, it runs there
    again: ``fn`` then waits for that second run and gets the parts of both. A hook left by a backward
    that failed before reaching the node removes itself and lets the gradient through."""
    task = torch._C._current_graph_task_id()
    parts = []

    def pre_hook(grad_outputs):
        if not accumulator.variable.requires_grad:
            # requires_grad_(False) after the forward: torch accumulates nothing into such a leaf.
            handle.remove()
            return (None,)
        now = torch._C._current_graph_task_id()
        if now == task and outer_task is not None and not parts:
            parts.append(grad_outputs[0])  # the nested backward's part; the hook stays for the outer one
            return (None,)
        handle.remove()
        if now != (task if outer_task is None else outer_task):
            return None
        other = [g for g in (*parts, grad_outputs[0]) if g is not None]
        fn(functools.reduce(torch.add, other) if other else None)
        return (None,)

    handle = accumulator.register_prehook(pre_hook)


torch.library.register_autograd("sonar_kernels::moe_mlp_fwd", _backward, setup_context=_setup_context)


def plain_eager(inputs) -> bool:
    """Whether this forward runs in plain eager mode: not traced by torch.compile, no torch function or
    dispatch mode active (FakeTensorMode, MemTracker, FlopCounterMode, ...), every tensor a plain
    ``torch.Tensor`` or ``nn.Parameter`` (no DTensor, no other subclass) on the CPU or a GPU. There the
    autograd formula runs as :class:`EagerMoeMlp`, without the custom op's dispatch (about 1 ms per
    call on a CPU: its argument handling grows with the op's inputs); elsewhere the op, which every
    mode, subclass and tracer understands."""
    if (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._len_torch_function_stack() > 0
        or inputs[0].device.type not in ("cpu", "cuda")
    ):
        return False
    for value in inputs:
        for t in value if isinstance(value, list) else (value,):
            if isinstance(t, torch.Tensor) and type(t) not in (torch.Tensor, torch.nn.Parameter):
                return False
    return True


class EagerMoeMlp(torch.autograd.Function):
    """The op ``sonar_kernels::moe_mlp_fwd`` and its registered autograd formula as a plain
    autograd.Function, for plain eager mode (:func:`plain_eager`): the same body, the same
    ``_setup_context`` and ``_backward``, so the same bits and the same in-backward updates."""

    @staticmethod
    def forward(ctx, *inputs):
        ctx.eager = True
        output = library.moe_mlp_fwd_body(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, *grads):
        # A list input (an update's state) is no autograd input of a Function: its gradient is None.
        return tuple(None if isinstance(g, list) else g for g in _backward(ctx, *grads))


def forward_inputs(hidden_states, top_k_index, top_k_weights, tensors, activation, backend, layout) -> tuple:
    """The forward op's inputs (``library.moe_mlp_fwd``) for checked arguments: ``tensors`` the expert
    tensors in :data:`sonar_kernels.specs.EXPERT_TENSORS` order (None where absent), each with the
    in-backward update its owner attached (:func:`update_for`). The op's and :class:`EagerMoeMlp`'s
    argument list, which torch's autograd.Function takes positionally: it stays in this module."""
    updates = tuple(None if t is None else update_for(t) for t in tensors)
    given = [u for u in updates if u is not None]
    first = given[0] if given else None
    states = [u.state() if u is not None else [] for u in updates]
    return (
        hidden_states, top_k_index, top_k_weights, *tensors, activation, backend, layout,
        [t for state in states for t in state], [len(state) for state in states],
        [u.hyper if u is not None else None for u in updates],
        [library.grad_dtype_code(u.grad_dtype if u is not None else None) for u in updates],
        _fused_epilogue(given),
        first.foreach if first is not None else None,
        first.torch_fused if first is not None else None,
    )  # fmt: skip


def _fused_epilogue(updates) -> bool | None:
    """The layer's path for its updates (``specs.ExpertUpdate.fused``): False when one asks for the split
    path, True when one asks for the fused epilogue (the least memory) or there is none, else None (the
    tuner's)."""
    paths = {u.fused for u in updates}
    return False if False in paths else True if True in paths or not paths else None


def apply(
    hidden_states, top_k_index, top_k_weights, *, activation, backend, layout, gate_up_proj, down_proj,
    up_proj=None, gate_up_proj_bias=None, down_proj_bias=None,
) -> torch.Tensor:  # fmt: skip
    """The expert MLP's output [T, H] for checked arguments (``autograd/moe_mlp.py``), with its autograd
    formula: :class:`EagerMoeMlp` in plain eager mode, else the op, on :func:`forward_inputs`."""
    tensors = (gate_up_proj, down_proj, up_proj, gate_up_proj_bias, down_proj_bias)  # EXPERT_TENSORS' order
    inputs = forward_inputs(hidden_states, top_k_index, top_k_weights, tensors, activation, backend, layout)
    outputs = EagerMoeMlp.apply(*inputs) if plain_eager(inputs) else library.moe_mlp_fwd(*inputs)
    out = outputs[0]
    if (
        not torch.compiler.is_compiling()
        and torch._C._current_graph_task_id() != -1
        and hasattr(out.grad_fn, "watched")
    ):
        # This forward runs inside a backward (reentrant activation checkpointing recomputes it there).
        node = out.grad_fn
        tensors = inputs[_FIRST_EXPERT : _FIRST_EXPERT + len(_WEIGHTS)]
        for watched, owner, weight in zip(node.watched, node.owners, tensors, strict=True):
            if watched is not None:
                watched.outer_task = outer_task_accumulating(weight, owner)
    return out
