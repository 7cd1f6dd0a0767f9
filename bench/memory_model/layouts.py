"""The step under each layout: one rank, data parallel (DDP's buckets, the experts' data-parallel reduction in
``sonar_kernels/optim/distributed.py``), expert parallel, EP x DP, and FSDP2 (its all-gathers and
reduce-scatters): the candidate moments of the step and the peak among them (:func:`predict`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

from memory_model.activations import (
    chunked_loss_moments,
    layer_saved,
    logits_dtype_bytes,
    rms_norm_saved,
    shared_saved,
)
from memory_model.expert_backward import (
    UPDATE_8BIT_BYTES_PER_ELEMENT,
    Tape,
    adamw_temporaries,
    remainder_update_temporaries,
    split_scratch_bytes,
    torch_expert_backward,
    triton_expert_backward,
)
from memory_model.inputs import (
    CATEGORIES,
    DDP_BUCKET,
    DDP_FIRST_BUCKET,
    FP32,
    INT32,
    INT64,
    Prediction,
    Setup,
    head_dim,
)
from memory_model.parameters import layer_of, local_shape, numel, optimizer_state_bytes, parameter_tensors

# --- the step -------------------------------------------------------------------------------------------


def gradient_order(names: list[str]) -> list[str]:
    """``names`` in the order the backward produces their gradients: the lm_head and the final norm, then
    each layer from the last (its experts, the router, post_attention_layernorm, o_proj, OLMoE's q_norm
    and k_norm, q/k/v_proj, input_layernorm), the embedding last."""
    rank = {"gate_up_proj": 0, "down_proj": 1, "router": 2, "post_attention_layernorm": 3, "o_proj": 4,
            "q_norm": 5, "k_norm": 6, "q_proj": 7, "k_proj": 8, "v_proj": 9, "input_layernorm": 10}  # fmt: skip

    def key(name):
        layer = layer_of(name)
        if layer is None:
            return (0 if name in ("lm_head", "norm") else 2, 0, 0 if name == "lm_head" else 1)
        return (1, -layer, rank[name.split(".")[-1]])

    return sorted(names, key=key)


def _ddp_buckets(names: list[str], nbytes: dict) -> list[tuple[int, set]]:
    """DDP's gradient buckets over ``names``, as DDP packs them after its first iteration (in the order
    the gradients became ready): a bucket closed once it holds at least its cap (about 1 MiB for the
    first, 25 MiB after): (bytes, names) per bucket."""
    buckets, current, size = [], set(), 0
    for name in gradient_order(names):
        current.add(name)
        size += nbytes[name]
        if size >= (DDP_FIRST_BUCKET if not buckets else DDP_BUCKET):
            buckets.append((size, current))
            current, size = set(), 0
    if current:
        buckets.append((size, current))
    return buckets


def predict(s: Setup) -> Prediction:
    """The predicted per-rank peak of one training step of ``s``, in bytes (see the package docstring): the
    largest of the step's candidate moments, with ``terms`` naming every byte count alive then and
    ``breakdown`` grouping them in MemTracker's categories (:data:`CATEGORIES`). Under expert
    parallelism, the rank whose experts receive ``s.expert_rows``; under FSDP2, rank 0."""
    d, p, T, L, lay = s.dims, s.param_bytes, s.tokens, s.dims.num_layers, s.layout
    a = s.compute_bytes or p
    H, E, V = d.hidden_size, d.num_experts, d.vocab_size
    tensors = parameter_tensors(d)
    if lay.fsdp > 1:
        return _predict_fsdp(s, tensors)
    nbytes = {name: numel(local_shape(shape, expert, lay)) * p for name, shape, expert in tensors}
    is_expert = {name: expert for name, _, expert in tensors}
    names = [name for name, _, _ in tensors]
    static = {
        "parameters": sum(nbytes.values()),
        "buffers": 2 * (head_dim(d) // 2) * p,  # rotary inv_freq and original_inv_freq, cast with the model
        "optimizer_state": optimizer_state_bytes(
            nbytes, is_expert, p, s.moments, s.master
        ),  # moments, fp32 step
    }
    if s.fp32_masters:  # Fp32Masters: an fp32 copy of every bf16 parameter, AdamW's moments over the copies
        static["fp32_masters"] = 2 * static["parameters"]
        fp32 = {name: 2 * size for name, size in nbytes.items()}
        static["optimizer_state"] = optimizer_state_bytes(fp32, is_expert, FP32, "exact")
    in_backward = s.method != "standard"  # expert gradients never reach .grad outside the backward
    reduce_first = in_backward and lay.dp > 1  # averaged over the data-parallel group before the update

    def kept_grad(name):  # the gradients that stay in .grad until the optimizer step
        return not (in_backward and is_expert[name])

    # DDP (sonar-train wraps the model on several ranks) holds the dense parameters, and the experts
    # too in the standard arm of a data-parallel layout; gradient_as_bucket_view=False: a second copy.
    ddp_names = []
    if lay.ranks > 1:
        ddp_names = [n for n in names if not is_expert[n] or (s.method == "standard" and lay.ep == 1)]
    buckets = _ddp_buckets(ddp_names, nbytes)

    def ddp_bytes(ready: set) -> int:
        if not s.tracker:
            return sum(size for size, _ in buckets)
        return sum(size for size, members in buckets if members & ready)

    w1 = nbytes["layers.0.gate_up_proj"]
    w2 = nbytes["layers.0.down_proj"]
    # The rows of this rank's experts per layer: T * top_k on one rank or data parallel; under expert
    # parallelism the rows it receives (balanced routing: T * top_k on average, unless given).
    rows = list(s.expert_rows or [T * d.top_k] * L)
    mask = s.sequence_length if s.causal_mask else 0
    saved = [layer_saved(d, T, a, lay, rows[layer], mask) for layer in range(L)]
    x = T * H * a  # one layer's input (the residual stream)
    shared = shared_saved(d, s.batch_size, s.sequence_length, a, s.checkpointing, s.causal_mask)
    ld = logits_dtype_bytes(d, a)
    # Layer inputs stay alive: as checkpoints, or (fp32, no checkpointing) as input_layernorm's input.
    inputs_kept = s.checkpointing or a == FP32
    final_norm = rms_norm_saved(T, H, a) + x + (x if a == FP32 else 0)  # + its output; fp32: its input

    def activations(upto: int) -> int:
        """Saved activations of layers [0, upto) and the layer inputs up to layer ``upto``."""
        if s.checkpointing:
            return upto * x
        total = sum(sum(part.values()) for layer in range(upto) for part in saved[layer])
        return total + (upto * x if inputs_kept else 0)

    moments = []  # (phase, terms)

    def add(phase, terms):
        moments.append((phase, {k: v for k, v in terms.items() if v}))

    # The forward's end: the cross-entropy (logits [T, V] in a, their fp32 copy in 16 bits, log_softmax's
    # saved output [T, V] fp32) and the load-balancing loss (each layer's router logits, captured; its
    # per-layer softmax saved).
    act_all = activations(L) + final_norm + shared + L * T * E * ld
    logits = T * V * a
    if s.loss_chunk_tokens is None:
        add("forward", {"activations": act_all, "logits": logits, "logits_fp32": T * V * FP32 if a != FP32 else 0,
                        "log_softmax": T * V * FP32})  # fmt: skip
        add("forward", {"activations": act_all, "logits": logits, "log_softmax": T * V * FP32,
                        "aux_loss_softmax": L * T * E * ld})  # fmt: skip
        # The loss's backward: log_softmax's output, the gradient in and out of it (fp32 [T, V] each); the
        # load-balancing loss ran first and left every layer's router-logit gradient.
        add("backward", {"activations": act_all - L * T * E * ld, "router_logit_gradients": L * T * E * ld,
                         "log_softmax_and_gradients": 3 * T * V * FP32})  # fmt: skip
    else:  # the chunked loss, after the model's forward (its load-balancing loss made, not yet run back)
        # Its backward runs with the model's output gone: the router logits it held released, the
        # load-balancing loss's saved softmax alive.
        forward, backward = chunked_loss_moments(d, T, a, s.loss_chunk_tokens)
        for terms in forward:
            add("forward", {"activations": act_all, "aux_loss_softmax": L * T * E * ld, **terms})
        for terms in backward:
            add(
                "backward",
                {"activations": act_all - L * T * E * ld, "aux_loss_softmax": L * T * E * ld, **terms},
            )
    if s.method == "standard" or reduce_first:
        mode = "grad"
    elif s.backend == "torch":
        mode = "deferred"
    else:  # sonar's fused update, or the split path: sonar's by chunks of experts, the paper's whole
        mode = "fused" if s.method == "sonar" and s.fused_epilogue else "split"
    scratch = {}
    if mode == "split":
        shapes = {name: local_shape(shape, expert, lay) for name, shape, expert in tensors}
        scratch = {
            f"{w}_scratch": split_scratch_bytes(shapes[f"layers.0.{name}"], p, whole=s.method == "paper")
            for w, name in (("w1", "gate_up_proj"), ("w2", "down_proj"))
        }
    ready = {"lm_head", "norm"}
    grads = nbytes["lm_head"] + nbytes["norm"]
    for layer in reversed(range(L)):  # each layer's expert backward, the last layer first
        kept, moe, _ = saved[layer]
        n = {"S": rows[layer], "T": rows[layer] if lay.ep > 1 else T, "k": 1 if lay.ep > 1 else d.top_k, "H": H,
             "I": d.intermediate_size, "a": a, "w1": w1, "w2": w2, "E": d.num_experts // lay.ep,
             "routing_grad": lay.ep == 1, **scratch}  # fmt: skip
        # The node's saved tensors (autograd gives its unused outputs, Hpre and the metadata, no zero
        # gradients: autograd/formula.py turns their materialization off).
        node = sum(moe.values())
        if d.family == "granitemoe":
            node += x  # the experts' dY: dO times the residual multiplier
        if lay.ep > 1:
            # the experts' dY, after the reverse all-to-all and the 1 / ep scaling; the gradient of the
            # combine's routing weights [T, k]
            node += rows[layer] * H * a + T * d.top_k * a
        # optim/distributed.py's MAX_IN_FLIGHT = 2 tensors: the layer after's, their all-reduce in flight
        in_flight = w1 + w2 if reduce_first and layer < L - 1 else 0
        tape = Tape({
            "activations": activations(layer) + (x if inputs_kept else 0) + sum(kept.values()) + shared,
            "router_logit_gradients": (layer + 1) * T * E * ld,
            "incoming_gradient": x,
            "gradients": grads,
            "ddp_buckets": ddp_bytes(ready),  # this layer's own gradients come after its experts
            "in_flight_expert_gradients": in_flight,
            "node": node,
        })  # fmt: skip
        if mode == "grad" and s.tracker:
            # The node runs the sonar_kernels:: ops of the backward's jobs: a TorchDispatchMode (MemTracker)
            # sees their outputs, not the buffers inside them. The core op's (dX, the routing weights'
            # gradient, dHpre, A; expert parallel: the rows' weights are ones, which need no gradient), then
            # each weight's gradient op: W2's (its operand A released after it), W1's (dHpre after it).
            S, I = n["S"], n["I"]
            tape.alloc("dX", n["T"] * H * a)
            tape.alloc("d_routing_weights", 0 if lay.ep > 1 else T * d.top_k * a)
            tape.alloc("dHpre", S * 2 * I * a)
            tape.alloc("A", S * I * a)
            tape.alloc("grad:down_proj", w2)
            tape.free("A")
            tape.alloc("grad:gate_up_proj", w1)
            tape.free("dHpre")
        elif s.backend == "torch":
            torch_expert_backward(tape, n, mode, s.adamw, s.moments)
        else:
            triton_expert_backward(tape, n, mode)
        add("backward", tape.at_peak)
        if reduce_first and layer < L - 1:
            # This layer's W1 reached .grad: its all-reduce starts, and the oldest in flight (the layer
            # after's W1) is waited for and updated (torch's AdamW), while this layer's W2 waits.
            add("backward", {**{k: v for k, v in tape.live.items() if k in ("activations", "router_logit_gradients",
                             "incoming_gradient", "gradients", "ddp_buckets")},
                             "in_flight_expert_gradients": w1 + w2, "grad:gate_up_proj": w1,
                             "grad:down_proj": w2, "dX": tape.live.get("dX", 0),
                             "d_routing_weights": tape.live.get("d_routing_weights", 0),
                             "step:adamw": adamw_temporaries(s.adamw, [w1])})  # fmt: skip
        layer_names = [n for n in names if layer_of(n) == layer]
        ready |= set(layer_names)
        grads += sum(nbytes[n] for n in layer_names if kept_grad(n))
    # The embedding's backward: its weight's gradient [V, H] made while the gradient reaching it (the
    # first layer's input's, [T, H]) is still held; every other gradient kept so far.
    add("backward", {"gradients": grads + nbytes["embed_tokens"], "ddp_buckets": ddp_bytes(ready),
                     "incoming_gradient": x})  # fmt: skip
    ready.add("embed_tokens")
    grads += nbytes["embed_tokens"]
    # The optimizer step: torch.optim.AdamW over the parameters that have a gradient (all in standard,
    # the dense ones otherwise), after clipping; the loss and the norm are 0-dim fp32 tensors.
    stepped = [nbytes[n] for n in names if kept_grad(n)]
    if s.fp32_masters:
        # Fp32Masters.step (sonar_kernels/train/arms.py): ``master.grad = p.grad.float(); p.grad = None`` in
        # the parameters' order, so the fp32 gradients grow by twice what the bf16 ones lose: the most at
        # the last tensor (lm_head), whose bf16 gradient is held while its fp32 copy is made. Then
        # clip_grad_norm_ over the masters (torch._foreach_norm's 0-dim norm per tensor and their stack),
        # AdamW's step over the fp32 masters, and the in-place copy back into the bf16 parameters.
        masters = {"master_gradients": 2 * grads, "ddp_buckets": ddp_bytes(ready)}
        add("optimizer step", {**masters, "gradients": nbytes[names[-1]], "loss": FP32})
        add("optimizer step", {**masters, "loss_and_norm": 2 * FP32, "grad_norms": 2 * len(names) * FP32,
                               "step:adamw": adamw_temporaries(s.adamw, [2 * b for b in stepped])})  # fmt: skip
    else:
        add("optimizer step", {"gradients": grads, "ddp_buckets": ddp_bytes(ready), "loss_and_norm": 2 * FP32,
                               "step:adamw": adamw_temporaries(s.adamw, stepped)})  # fmt: skip
    if reduce_first:
        # The end of the backward: the last layer's expert gradients, applied in an engine callback.
        add("backward", {"gradients": grads, "ddp_buckets": ddp_bytes(ready), "grad:gate_up_proj": w1,
                         "grad:down_proj": w2, "step:adamw": adamw_temporaries(s.adamw, [w1])})  # fmt: skip
    phase, terms = max(moments, key=lambda m: sum(m[1].values()))
    terms = {**static, **terms}
    return Prediction(sum(terms.values()), _categories(terms, phase), phase, terms)


def _categories(terms: dict, phase: str) -> dict:
    """``terms`` in MemTracker's categories: a gradient that reached .grad is a gradient; AdamW's
    temporaries inside ``optimizer.step()`` are the step's temporaries, in the backward (the paper's
    in-backward update, the data-parallel updates) temporaries; activations and backward temporaries
    together (MemTracker files recomputed activations under either)."""
    out = dict.fromkeys(CATEGORIES, 0)
    for name, value in terms.items():
        if name in ("parameters", "buffers", "optimizer_state"):
            out[name] += value
        elif name in ("root_unsharded_parameters", "unsharded_parameters", "unsharded_expert_parameters",
                      "fp32_masters"):  # fmt: skip
            out["parameters"] += value
        elif name.startswith("grad:") or name in (
            "gradients", "in_flight_expert_gradients", "reduce_scatter_output", "master_gradients",
            "expert_gradients",
        ):  # fmt: skip
            out["gradients"] += value
        elif name == "step:adamw" and phase == "optimizer step":
            out["optimizer_step_temporaries"] += value
        else:
            out["activations_and_temporaries"] += value
    return out


def _ep_expert_backward(s: Setup, add, base: dict, act: int, previous_rs: int, moe: dict, rows: int, w1: int,
                        w2: int, mode: str) -> None:  # fmt: skip
    """One layer's expert backward under EP x FSDP2-dense (:func:`_predict_fsdp`): :func:`predict`'s expert
    parallel node and expert backward (``rows`` received rows, the local ``w1`` and ``w2`` bytes), with the
    layer's FSDP2 terms (``base``: the root's and this layer's unsharded dense parameters, the prefetched
    all-gather, the gradients so far) and the previous layer's reduce-scatter input alive."""
    d, T, H, a = s.dims, s.tokens, s.dims.hidden_size, s.compute_bytes or s.param_bytes
    lay = s.layout
    node = sum(moe.values()) + (T * H * a if d.family == "granitemoe" else 0)
    node += rows * H * a + T * d.top_k * a  # the experts' dY (its rows), the combine weights' gradient
    n = {"S": rows, "T": rows, "k": 1, "H": H, "I": d.intermediate_size, "a": a, "w1": w1, "w2": w2,
         "E": d.num_experts // lay.ep, "routing_grad": False}  # fmt: skip
    if mode == "split":
        shapes = {name: local_shape(shape, expert, lay) for name, shape, expert in parameter_tensors(d)}
        n |= {f"{w}_scratch": split_scratch_bytes(shapes[f"layers.0.{name}"], s.param_bytes, whole=s.method == "paper")
              for w, name in (("w1", "gate_up_proj"), ("w2", "down_proj"))}  # fmt: skip
    if s.checkpointing:
        add("backward", {**base, "activations": act, "previous_reduce_scatter_input": previous_rs,
                         **_ep_recompute_combine(s, rows), "node": sum(moe.values())})  # fmt: skip
    tape = Tape({**base, "activations": act, "previous_reduce_scatter_input": previous_rs, "node": node})
    if s.backend == "torch":
        torch_expert_backward(tape, n, mode, s.adamw, s.moments)
    else:
        triton_expert_backward(tape, n, mode)
    add("backward", tape.at_peak)


def _ep_recompute_combine(s: Setup, rows: int) -> dict:
    """What the recomputed forward of a checkpointed layer holds at its combine under expert parallelism
    (``sonar_kernels/nn/expert_parallel.py``, ``index_copy`` of the weighted rows into the slots), besides
    the layer's saved tensors and the experts' node: the residual [T, H], the router logits [T, E] and the
    routing weights [T, top_k]; the dispatch's locals (the kept mask, the destination ranks and their sort
    order [S], the local expert ids [S] int32 sent and [rows] received); the experts' output [rows, H] and
    the rows returned [S, H]; the combine's fp32 terms: the rows as fp32, their weights, the weighted rows,
    the zeros they are copied into and the copy's output."""
    d, T, H, a = s.dims, s.tokens, s.dims.hidden_size, s.compute_bytes or s.param_bytes
    S = T * d.top_k
    return {
        "residual": T * H * a,
        "router_logits": T * d.num_experts * logits_dtype_bytes(d, a),
        "routing_weights": T * d.top_k * a,
        "dispatch_indices": S * (1 + INT64 + INT64 + INT32) + rows * INT32,
        "expert_output": rows * H * a,
        "returned_rows": S * H * a,
        "combine_fp32": 4 * S * H * FP32 + S * FP32,
    }


def _predict_fsdp(s: Setup, tensors) -> Prediction:
    """FSDP2 as docs/distributed.md's recipe applies it (``fully_shard`` of every experts module, then of every decoder
    layer, then of the model), from torch's ``_fully_shard/_fsdp_param_group.py`` and
    ``_fsdp_collectives.py``, on rank 0 (whose shards are the padded ones).

    The root's parameters (embedding, final norm, lm_head) stay unsharded from the forward to the end of
    the backward (``reshard_after_forward`` is False for the root). Each group (a layer's dense
    parameters, its experts) is all-gathered for its forward and again for its backward: a flat buffer of
    every rank's padded shard, copied out into the unsharded parameters, then freed; the backward
    prefetches the next group's all-gather (the previous layer's dense group during this layer's expert
    backward). A group's post-backward copies its unsharded gradients into a reduce-scatter input
    (padded; kept until the next group's post-backward starts), frees them, and reduces into one flat
    shard of which every parameter's sharded gradient is a view; gloo's reduce-scatter works on a copy
    of the input. The experts' forward runs on the unsharded tensors, which carry no update: their
    backward returns both gradients in every method; SonarAdamW then updates each expert shard from its
    reduced gradient and releases it (the experts group's flat shard is freed).

    fp32 parameters with bf16 activations (``compute_bytes`` 2, ``param_bytes`` 4) are FSDP2's
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (``_fsdp_param.py`` ``init_dtype_attrs``,
    ``_fsdp_collectives.py``): the shards, their gradients and AdamW's state in fp32; the all-gather (its
    inputs cast to bf16 by a foreach copy), the unsharded parameters, the model's computation and its
    unsharded gradients in bf16; each reduce-scatter input in fp32 (``chunk_cat`` of the bf16 gradients
    into an fp32 buffer) and its output, the sharded gradients, in fp32 (the shards' own dtype: no cast).

    With ``layout.ep`` (= ``fsdp``): expert parallelism with the dense layers on FSDP2 (docs/distributed.md,
    "Expert parallel with the dense layers on FSDP2"; ``fully_shard`` of every decoder layer and of the
    model with the expert tensors in ``ignored_params``). Each rank holds its E / ep experts whole: no
    experts group, no all-gather or reduce-scatter of them; the tokens reach them by all-to-all, balanced
    (T * top_k rows a layer), and their backward is :func:`predict`'s under expert parallelism (the Triton
    or torch expert backward: the gradients kept in ``.grad`` by standard training, the update fused or
    split in the backward otherwise), inside the FSDP2 terms of the layer around it."""
    from sonar_kernels.ops.torch_backend.fp64_update import UPDATE_ELEMENTS

    d, p, T, L, lay = s.dims, s.param_bytes, s.tokens, s.dims.num_layers, s.layout
    a = s.compute_bytes or p
    H, E, V, N = d.hidden_size, d.num_experts, d.vocab_size, lay.fsdp
    # Unsharded: in the parameters' dtype, or under mixed precision in param_dtype (a); sharded in p.
    ep = lay.ep > 1
    # Under EP the experts are never all-gathered: their unsharded tensor is the rank's own E / ep.
    full = {
        name: numel(local_shape(shape, expert, lay) if expert and ep else shape) * a
        for name, shape, expert in tensors
    }
    shard = {name: numel(local_shape(shape, expert, lay)) * p for name, shape, expert in tensors}
    expert_names = {name for name, _, expert in tensors if expert}
    names = [name for name, _, _ in tensors]
    root = ("embed_tokens", "norm", "lm_head")

    def group(layer, experts):
        return [n for n in names if layer_of(n) == layer and (n in expert_names) == experts]

    def total(table, layer, experts):
        return sum(table[n] for n in group(layer, experts)) if 0 <= layer < L else 0

    def padded(layer, experts):  # a reduce-scatter input: every rank's padded shard, in the reduce dtype (p)
        return N * total(shard, layer, experts)

    def gathered(layer, experts):  # an all-gather output: every rank's padded shard, in a (param_dtype)
        return N * total(shard, layer, experts) // p * a

    static = {
        "parameters": sum(shard.values()),
        "buffers": 2 * (head_dim(d) // 2) * p,
        "optimizer_state": optimizer_state_bytes(
            shard, {n: n in expert_names for n in shard}, p, s.moments, s.master
        ),
    }
    gloo = s.collectives == "gloo"
    in_backward = s.method != "standard"
    root_unsharded = sum(full[n] for n in root)
    rows = [T * d.top_k] * L
    mask = s.sequence_length if s.causal_mask else 0
    saved = [layer_saved(d, T, a, lay, rows[layer], mask) for layer in range(L)]
    x = T * H * a
    shared = shared_saved(d, s.batch_size, s.sequence_length, a, s.checkpointing, s.causal_mask)
    ld = logits_dtype_bytes(d, a)
    inputs_kept = s.checkpointing or a == FP32
    final_norm = rms_norm_saved(T, H, a) + x + (x if a == FP32 else 0)

    def activations(upto: int) -> int:
        if s.checkpointing:
            return upto * x
        return sum(sum(part.values()) for layer in range(upto) for part in saved[layer]) + (
            upto * x if inputs_kept else 0
        )

    moments = []

    def add(phase, terms):
        moments.append((phase, {k: v for k, v in terms.items() if v}))

    def reduce_scatter(terms, rs_input, out, held=0):
        """The post-backward from its copy-in: the unsharded gradients in ``terms`` are copied into the
        input, freed (but ``held`` bytes of them), and reduced into ``out`` bytes of shard (gloo: on a copy
        of the input)."""
        add("backward", {**terms, "reduce_scatter_input": rs_input})
        terms = {k: v for k, v in terms.items() if k != "unsharded_gradients"}
        add("backward", {**terms, "reduce_scatter_input": rs_input, "gloo_reduce_scatter_copy": rs_input if gloo else 0,
                         "reduce_scatter_output": out, "down_proj_node_output": held})  # fmt: skip

    act_all = activations(L) + final_norm + shared + L * T * E * ld
    # The forward's last all-gather (the last layer's experts) is kept for the next copy-out
    # (``comm_ctx.all_gather_state``, _fsdp_param_group.py ``wait_for_unshard``) until the root's
    # post-forward frees it (_fsdp_state.py ``_post_forward``): through the lm_head and the losses, which
    # the model's forward computes.
    last_all_gather = gathered(L - 1, not ep)  # under EP the last layer's dense group: no experts group
    if s.loss_chunk_tokens is not None:
        # The chunked loss runs after the model's forward (the root's post-forward has freed the last
        # all-gather) and its backward before the load-balancing loss's, whose output's hook is the root's
        # pre-backward (no prefetch yet); the model's output gone by then, with the router logits it held.
        forward, backward = chunked_loss_moments(d, T, a, s.loss_chunk_tokens)
        around = {"root_unsharded_parameters": root_unsharded, "aux_loss_softmax": L * T * E * ld}
        for terms in forward:
            add("forward", {**around, "activations": act_all, **terms})
        for terms in backward:
            add("backward", {**around, "activations": act_all - L * T * E * ld, **terms})
    else:
        add("forward", {"root_unsharded_parameters": root_unsharded, "activations": act_all, "logits": T * V * a,
                        "logits_fp32": T * V * FP32 if a != FP32 else 0, "log_softmax": T * V * FP32,
                        "last_all_gather": last_all_gather})  # fmt: skip
        add("forward", {"root_unsharded_parameters": root_unsharded, "activations": act_all, "logits": T * V * a,
                        "log_softmax": T * V * FP32, "aux_loss_softmax": L * T * E * ld,
                        "last_all_gather": last_all_gather})  # fmt: skip
        # The loss's backward: the root's pre-backward (the loss's gradient hook, _fsdp_state.py
        # ``_pre_backward``) has prefetched the next group in reverse forward order, the last layer's dense one.
        add("backward", {"root_unsharded_parameters": root_unsharded, "activations": act_all - L * T * E * ld,
                         "router_logit_gradients": L * T * E * ld, "log_softmax_and_gradients": 3 * T * V * FP32,
                         "prefetched_all_gather": gathered(L - 1, False)})  # fmt: skip
    sharded_grads = 0
    root_grads = full["lm_head"] + full["norm"]  # unsharded until the root's reduce-scatter at the end
    w1, w2 = full["layers.0.gate_up_proj"], full["layers.0.down_proj"]
    w1_shard = shard["layers.0.gate_up_proj"]
    previous_rs = 0  # the last reduce-scatter input, kept until the next post-backward
    expert_grads = 0  # EP, standard: the expert gradients kept in .grad so far (they are not sharded)
    mode = "grad" if not in_backward else "fused" if s.method == "sonar" and s.fused_epilogue else "split"
    if ep and s.backend == "torch" and in_backward:
        mode = "deferred"
    for layer in reversed(range(L)):
        kept, moe, _ = saved[layer]
        act = activations(layer) + (x if inputs_kept else 0) + sum(kept.values()) + shared
        if ep:
            base = {
                "root_unsharded_parameters": root_unsharded,
                "unsharded_parameters": total(full, layer, False),
                "prefetched_all_gather": gathered(layer - 1, False),
                "gradients": sharded_grads + root_grads,
                "expert_gradients": expert_grads,
                "router_logit_gradients": (layer + 1) * T * E * ld,
                "incoming_gradient": x,
            }
            _ep_expert_backward(s, add, base, act, previous_rs, moe, rows[layer], w1, w2, mode)
            if not in_backward:  # standard: this rank's expert gradients stay in .grad to the step
                expert_grads += w1 + w2
            base["gradients"], base["expert_gradients"] = sharded_grads + root_grads, expert_grads
            base["router_logit_gradients"] = layer * T * E * ld
            reduce_scatter({**base, "activations": act - sum(kept.values()), "unsharded_gradients": total(full, layer, False)},
                           padded(layer, False), total(shard, layer, False))  # fmt: skip
            sharded_grads += total(shard, layer, False)
            previous_rs = padded(layer, False)
            continue
        node = sum(moe.values()) + rows[layer] * 2 * d.intermediate_size * a + kept["routing_metadata"]
        if d.family == "granitemoe":
            node += x
        base = {
            "root_unsharded_parameters": root_unsharded,
            "unsharded_parameters": total(full, layer, False),
            "prefetched_all_gather": gathered(layer - 1, False),
            "gradients": sharded_grads + root_grads,
            "router_logit_gradients": (layer + 1) * T * E * ld,
            "incoming_gradient": x,
        }
        outputs = {"dX": T * H * a, "d_routing_weights": T * d.top_k * a}
        add("backward", {**base, "unsharded_expert_parameters": total(full, layer, True), "activations": act,
                         "previous_reduce_scatter_input": previous_rs, "node": node, **outputs,
                         "grad:gate_up_proj": w1, "grad:down_proj": w2})  # fmt: skip
        # The experts' post-backward (their parameters resharded, the previous input released). It runs
        # from the engine before the node's down_proj output is released: that tensor, the unsharded
        # gradient AccumulateGrad took, outlives its copy-in (measured: one W2 more after it; the traced
        # Triton step, bench/memory_real.py: not before it).
        reduce_scatter({**base, "activations": act - kept["routing_metadata"], **outputs,
                        "unsharded_gradients": w1 + w2}, padded(layer, True), total(shard, layer, True), w2)  # fmt: skip
        if in_backward:
            # Each expert shard updated (torch AdamW) from its reduced gradient, then released: SonarAdamW's
            # post-accumulate-grad hook, which foreach_reduce calls (_fsdp_collectives.py) with the
            # reduce-scatter's input and output alive, in the post-backward that still sees the node's
            # down_proj output; gate_up_proj's shard first, the larger. Its temporaries: torch's AdamW's; with
            # 8-bit moments the slices of ops/torch_backend/fp64_update.py's update; with a remainder (exact moments) the
            # shard's fp32 master and split's int64 bits (updates.py ``apply_grad``).
            update = adamw_temporaries(s.adamw, [w1_shard])
            if s.moments == "8bit":
                update = UPDATE_8BIT_BYTES_PER_ELEMENT * min(UPDATE_ELEMENTS, w1_shard // p)
            elif s.master == "remainder":
                update = remainder_update_temporaries(w1_shard // p)
            add("backward", {**base, "activations": act - kept["routing_metadata"], **outputs,
                             "down_proj_node_output": w2, "reduce_scatter_input": padded(layer, True),
                             "reduce_scatter_output": total(shard, layer, True), "step:adamw": update})  # fmt: skip
        else:
            sharded_grads += total(shard, layer, True)
        # The layer's post-backward: its dense gradients.
        base["gradients"] = sharded_grads + root_grads
        base["router_logit_gradients"] = layer * T * E * ld
        reduce_scatter({**base, "activations": act - sum(kept.values()), "unsharded_gradients": total(full, layer, False)},
                       padded(layer, False), total(shard, layer, False))  # fmt: skip
        sharded_grads += total(shard, layer, False)
        previous_rs = padded(layer, False)
    # The embedding's backward (its unsharded gradient, the gradient reaching it held), then the root's
    # post-backward (the engine's final callback, _fsdp_state.py): its parameters resharded, its
    # unsharded gradients reduce-scattered.
    embedding = full["embed_tokens"]
    add("backward", {"root_unsharded_parameters": root_unsharded, "gradients": sharded_grads + root_grads + embedding,
                     "expert_gradients": expert_grads, "incoming_gradient": x,
                     "previous_reduce_scatter_input": previous_rs})  # fmt: skip
    root_shard = sum(shard[n] for n in root)
    reduce_scatter({"gradients": sharded_grads, "expert_gradients": expert_grads,
                    "unsharded_gradients": root_grads + embedding}, N * root_shard, root_shard)  # fmt: skip
    grads = sharded_grads + root_shard
    stepped = [shard[n] for n in names if not (in_backward and n in expert_names)]
    add("optimizer step", {"gradients": grads, "expert_gradients": expert_grads, "loss_and_norm": 2 * FP32,
                           "step:adamw": adamw_temporaries(s.adamw, stepped)})  # fmt: skip
    phase, terms = max(moments, key=lambda m: sum(m[1].values()))
    terms = {**static, **terms}
    return Prediction(sum(terms.values()), _categories(terms, phase), phase, terms)
