"""The expert backward's terms: the gradients, temporaries and AdamW temporaries alive during one layer's
expert backward, op by op, as ``sonar_kernels/ops/torch_backend/mlp.py`` (torch backend),
``sonar_kernels/ops/triton_backend/backward.py`` and ``sonar_kernels/ops/triton_backend/wgrad.py`` (Triton) and
``sonar_kernels/autograd/formula.py`` (the jobs' order) run them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

from memory_model.inputs import DHPRE_BLOCK_N, FP32, INT32, INT64

# --- the backward of one layer's experts ----------------------------------------------------------------


def adamw_temporaries(adamw: str, sizes: list[int]) -> int:
    """Bytes torch's AdamW allocates while it updates tensors of ``sizes`` bytes (in the optimizer's
    order) in one call. The single-tensor implementation computes ``denom = (exp_avg_sq.sqrt() /
    bias_correction2_sqrt).add_(eps)`` per tensor: two tensors of the one it updates while the previous
    tensor's ``denom`` is still referenced; foreach: ``_foreach_sqrt`` of all of them; fused: none."""
    if not sizes:
        return 0
    if adamw == "single":
        return max(2 * size + (sizes[i - 1] if i else 0) for i, size in enumerate(sizes))
    if adamw == "foreach":
        return sum(sizes)
    return 0


def remainder_update_temporaries(elements: int) -> int:
    """Bytes ``sonar_kernels/ops/torch_backend/adamw.py``'s ``remainder_adamw_`` holds at its peak on a tensor of
    ``elements`` bf16 weights with an int16 remainder, not chunked (SonarAdamW's update of an FSDP2 shard
    from its reduced gradient, ``optim/updates.py`` ``apply_grad``): ``split`` of the merged fp32 master (4
    bytes per element), with the master's bits as int64, their rounded high half, that half shifted back
    and the difference (8 bytes each) alive together. (merge's int64 sum and torch's AdamW on the master
    with the gradient as fp32 hold less.)"""
    return elements * (FP32 + 4 * INT64)


class Tape:
    """Allocations and frees in program order, by name, in bytes; :attr:`peak` is the largest sum of the
    live tensors (with a :meth:`moment`'s transient ones) and :attr:`at_peak` those tensors then."""

    def __init__(self, live: dict | None = None):
        self.live = dict(live or {})
        self.peak, self.at_peak = -1, {}
        self._note()

    def _note(self, transient: dict | None = None) -> None:
        now = dict(self.live)
        for name, nbytes in (transient or {}).items():
            now[name] = now.get(name, 0) + nbytes
        total = sum(now.values())
        if total > self.peak:
            self.peak, self.at_peak = total, now

    def alloc(self, name: str, nbytes: int) -> None:
        self.live[name] = self.live.get(name, 0) + nbytes
        self._note()

    def free(self, *names: str) -> None:
        for name in names:
            self.live.pop(name, None)

    def moment(self, **transient: int) -> None:
        """A moment at which ``transient`` tensors are alive besides the live ones (freed right after)."""
        self._note(transient)


# The torch ops' 8-bit update (sonar_kernels/rules/update.py, run op by op) at its peak holds
# about 66 bytes per element of the call (fp64 copies of the weight, gradient and moments, the dequantized
# and requantized moments, the table search's int32 indices; MemTracker: 65.6), on UPDATE_ELEMENTS
# elements per call.
UPDATE_8BIT_BYTES_PER_ELEMENT = 66


def torch_expert_backward(tape: Tape, n: dict, mode: str, adamw: str, moments: str = "exact") -> None:
    """The torch backend's expert backward, SwiGLU (ops/torch_backend/mlp.py ``moe_mlp_bwd_core``, then each
    weight's job, ``expert_gradient``), then the deferred updates of an in-backward ``mode`` ("grad": the
    jobs return both weight gradients; "deferred": W1's then W2's wgrad and torch AdamW run in the weights'
    AccumulateGrad pre-hooks, autograd/formula.py, by chunks of experts with torch's fused AdamW,
    ops/torch_backend/adamw.py ``torch_adamw_chunked_``). ``n``: sizes in bytes: S rows, T tokens, H, I, ``a``
    (activation bytes), w1 and w2 (the local weight tensors), E (the local experts), ``routing_grad``
    (whether the routing weights get a gradient: not under expert parallelism, where they are ones).
    ``moments`` "8bit": the update is chunked whatever ``adamw`` (ops/torch_backend/fp64_update.py ``adamw_8bit_``), each
    chunk updated :data:`UPDATE_ELEMENTS` at a time."""
    from sonar_kernels.ops.torch_backend.fp64_update import UPDATE_ELEMENTS
    from sonar_kernels.ops.torch_backend.mlp import ROW_BLOCK_BYTES, WGRAD_CHUNK_BYTES

    S, T, k, H, I, a, w1, w2, E = (n[key] for key in ("S", "T", "k", "H", "I", "a", "w1", "w2", "E"))
    wide = a != FP32  # 16-bit activations: .float() copies
    routing_grad = n.get("routing_grad", True)

    def block_rows(width: int) -> int:
        """The rows of the largest block of whole experts of at most ROW_BLOCK_BYTES per fp32 row of
        ``width`` (balanced routing: at least one expert's share)."""
        return min(S, max(ROW_BLOCK_BYTES // (FP32 * width), -(-S // E)))

    sub = min(S, max(1, ROW_BLOCK_BYTES // (FP32 * I)))  # the elementwise blocks of rows
    # The core: the rows' tokens and routing weights (locals of the core).
    tape.alloc("token_ids", S * INT64)
    tape.moment(valid=S, slot_ids=S * INT64, weights_gathered=S * a + (S * FP32 if wide else 0))
    tape.alloc("weight_per_row", S * FP32)
    tape.alloc("per_row", S * FP32 if routing_grad else 0)
    # dHpre: written over the saved Hpre when the graph is freed after this backward (eager, deferred: the
    # node's Hpre becomes dHpre, which W1's job holds past the node), else a tensor of its own.
    if mode != "grad":
        tape.live["node"] -= S * 2 * I * a
    tape.alloc("dHpre", S * 2 * I * a)
    tape.alloc("A", S * I * a)
    # G by blocks of experts (dO's rows gathered, the GEMM's output), then SwiGLU's backward by blocks of
    # rows: gate, up (fp32 copies when 16-bit), silu, the product for <G, A>, sigmoid, its derivative, d gate.
    rows = block_rows(max(H, I))
    tape.alloc("g_blocks", rows * (H + I) * a + (rows * I * FP32 if wide else 0))
    tape.moment(swiglu_blocks=sub * I * FP32 * (5 + (4 if wide else 0)))
    tape.free("g_blocks")
    if routing_grad:  # d top_k_weights: per slot (the row of each slot, as int64), [T, k]
        tape.moment(slot_rows=S * INT64, per_slot=2 * S * FP32)
        tape.alloc("d_routing_weights", T * k * a)
    tape.free("per_row")
    # dX: a block of experts' rows dHpre @ W1[e] at a time, added to its tokens in fp32; then in a.
    tape.alloc("dX_fp32", T * H * FP32)
    rows = block_rows(H)
    tape.moment(token_ids_dx=S * INT64, dX_block=rows * H * a + (rows * H * FP32 if wide else 0))
    if wide:
        tape.alloc("dX", T * H * a)
        tape.free("dX_fp32")
    else:
        tape.live["dX"] = tape.live.pop("dX_fp32")
    tape.free("token_ids", "weight_per_row")
    # The jobs: each weight's gradient from the core's operands, with the rows' tokens (and W2's routing
    # weights) it gathers by; held by the deferred updates until they run.
    tape.alloc("w2_job", S * INT64 + S * FP32)
    tape.alloc("w1_job", S * INT64)
    if mode == "grad":  # each gradient whole: the gathered rows of dO (scaled) and of X
        tape.moment(**{"grad:down_proj": w2, "dO_rows": S * H * a + (S * H * FP32 if wide else 0)})
        tape.alloc("grad:down_proj", w2)
        tape.free("A", "w2_job")
        tape.moment(**{"grad:gate_up_proj": w1, "x_rows": S * H * a})
        tape.alloc("grad:gate_up_proj", w1)
        tape.free("w1_job")
        return
    # The deferred updates, after the node: W1's (with W2's job pending), then W2's. Torch's fused AdamW:
    # a chunk of experts' gradient at a time into one buffer, their rows gathered into another; else the
    # whole gradient and all its rows, then torch's AdamW (its temporaries).
    tape.free("node")
    if not routing_grad:  # expert parallel: dO is the node's dY (its rows), which W2's job gathers from
        tape.alloc("w2_job", S * H * a)
    for name, weight, extra in (
        ("gate_up_proj", w1, ("dHpre", "w1_job")),
        ("down_proj", w2, ("A", "w2_job")),
    ):
        if moments == "8bit":
            chunk = min(weight, max(WGRAD_CHUNK_BYTES, weight // E))
            rows = min(S, -(-S * chunk // weight))
            update = UPDATE_8BIT_BYTES_PER_ELEMENT * min(UPDATE_ELEMENTS, chunk // a)
            tape.moment(
                **{f"in_backward:{name}": chunk, "chunk_rows": rows * H * a, "step:adamw_8bit": update}
            )
        elif adamw == "fused":
            chunk = min(weight, max(WGRAD_CHUNK_BYTES, weight // E))
            rows = min(S, -(-S * chunk // weight))
            tape.moment(**{f"in_backward:{name}": chunk, "chunk_rows": rows * H * a})
        else:
            rows = S * H * a + (S * H * FP32 if wide and name == "down_proj" else 0)
            tape.moment(**{f"in_backward:{name}": weight, "rows": rows,
                           "step:adamw": adamw_temporaries(adamw, [weight])})  # fmt: skip
        tape.free(*extra)


def split_scratch_bytes(shape: tuple[int, ...], param_bytes: int, whole: bool = False) -> int:
    """Bytes of the Triton split path's gradient buffer for an expert tensor of local ``shape`` [E, ...]
    whose gradient has the parameters' dtype (``param_bytes``; SonarAdamW's default ``grad_dtype``): one
    chunk of whole experts, ``sonar_kernels.ops.triton_backend.wgrad_update.split_chunk`` (at most 1/8 of the tensor's
    gradient bytes or 64 MiB, whichever is larger), allocated once per update; ``whole``: under
    ``split_scratch(fraction=1)``, the paper's method, the whole gradient."""
    import contextlib
    import math

    import torch

    from sonar_kernels.ops.triton_backend.wgrad_update import split_chunk, split_scratch

    dtype = {2: torch.bfloat16, 4: torch.float32}[param_bytes]
    weight = torch.empty(shape, dtype=dtype, device="meta")
    with split_scratch(fraction=1) if whole else contextlib.nullcontext():
        experts = split_chunk(weight, dtype)
    return experts * math.prod(shape[1:]) * param_bytes


def weight_of_row(tape: Tape, S: int, a: int) -> None:
    """dW2's launch's rows' routing weights (ops/triton_backend/wgrad_launch.py ``weight_of_row``): [S] fp32, kept for the
    launch (freed with it, by the caller), made from the rows' slots clamped (int32) then as int64, the
    weights gathered (``a`` bytes) and cast to fp32 (no copy when ``a`` is fp32)."""
    tape.moment(slots=S * (INT32 + INT64))
    tape.alloc("weight_of_row", S * FP32)
    tape.moment(slots=S * INT64, weights_gathered=S * a if a != FP32 else 0)


def triton_expert_backward(tape: Tape, n: dict, mode: str) -> None:
    """The Triton backend's expert backward (ops/triton_backend/backward.py ``moe_mlp_bwd_core``, then each weight's job,
    ops/triton_backend/wgrad.py ``expert_wgrad``): dHpre [S, 2I], A [S, I] and the routing-weight partial sums
    [cdiv(I, 64), S] fp32 from the dHpre kernel; d top_k_weights; dX's rows [S, H] and dX [T, H]; then dW2
    (mode "grad"; A released after it; its rows' routing weights as fp32 during its launch) and dW1 (mode
    "grad"). ``mode`` "fused": the updates deferred and fused into the wgrad launches (no gradient tensor);
    "split": deferred, each tensor's gradient written into a buffer of ``n["w1_scratch"]`` and
    ``n["w2_scratch"]`` bytes (:func:`split_scratch_bytes`: a chunk of experts, or the whole gradient for the
    paper's method) and updated from it by the standalone AdamW kernel (no temporaries), chunk after
    chunk, the buffer released after the tensor's last chunk."""
    S, T, k, H, I, a, w1, w2 = (n[key] for key in ("S", "T", "k", "H", "I", "a", "w1", "w2"))
    tape.alloc("dHpre", S * 2 * I * a)
    tape.alloc("A", S * I * a)
    tape.alloc("dw_partial", -(-I // DHPRE_BLOCK_N) * S * FP32)
    tape.alloc("d_routing_weights", T * k * a)
    tape.free("dw_partial")
    tape.alloc("dX", T * H * a)
    tape.moment(dX_rows=S * H * a)
    if mode == "grad":
        weight_of_row(tape, S, a)
        tape.alloc("grad:down_proj", w2)
        tape.free("A", "weight_of_row")
        tape.alloc("grad:gate_up_proj", w1)
        return
    tape.free("node")
    # W1's deferred update, then W2's (its rows' routing weights made first).
    scratch = mode == "split"
    tape.moment(**{"in_backward:gate_up_proj": n["w1_scratch"] if scratch else 0})
    tape.free("dHpre")
    weight_of_row(tape, S, a)
    tape.moment(**{"in_backward:down_proj": n["w2_scratch"] if scratch else 0})
    tape.free("weight_of_row")
