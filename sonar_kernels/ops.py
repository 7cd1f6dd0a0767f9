"""Host launchers: validate, allocate, build the grid, launch. No host sync on any path here."""

from __future__ import annotations

import contextlib

import torch
import triton

from sonar_kernels.kernels.expert_mlp_fwd import (
    COMBINE_CONFIG,
    FWD_GEMM_CONFIG,
    TILE_M,
    _expert_mlp_fwd_combine_kernel,
    _expert_mlp_fwd_down_kernel,
    _expert_mlp_fwd_up_kernel,
)
from sonar_kernels.kernels.routing import _routing_metadata_kernel
from sonar_kernels.reference import ACTIVATIONS, RoutingMetadata

BACKENDS = ("auto", "triton", "torch")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
# The routing kernel holds a [BLOCK_S, BLOCK_E] one-hot tile of the experts in registers.
MAX_EXPERTS = 1024


def triton_interpreting() -> bool:
    """True when the Triton kernels run under the interpreter (TRITON_INTERPRET=1 before import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_routing_metadata_kernel, InterpretedFunction)


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every buffer a launcher allocates comes from here (tests fill it with NaN to catch unwritten data)."""
    return torch.empty(shape, dtype=dtype, device=device)


def check_moe_mlp_args(
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, backend
) -> str:
    """Validate the arguments of :func:`sonar_kernels.moe_mlp` and resolve ``backend``.

    Returns:
        "triton" or "torch".
    Raises:
        TypeError: an argument is not a tensor, or has a dtype outside what is supported.
        ValueError: shapes disagree, tensors are on different devices, unknown activation or backend,
            or backend "triton" for CPU tensors without the Triton interpreter.
    """
    tensors = {
        "hidden_states": hidden_states,
        "top_k_index": top_k_index,
        "top_k_weights": top_k_weights,
        "gate_up_proj": gate_up_proj,
        "down_proj": down_proj,
    }
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    # dtypes
    if hidden_states.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"hidden_states must be float32, bfloat16 or float16, got {hidden_states.dtype}")
    if top_k_index.dtype not in INDEX_DTYPES:
        raise TypeError(f"top_k_index must be int32 or int64 expert ids, got {top_k_index.dtype}")
    if top_k_weights.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"top_k_weights must be float32, bfloat16 or float16, got {top_k_weights.dtype}")
    for name in ("gate_up_proj", "down_proj"):
        w = tensors[name]
        if w.dtype not in (hidden_states.dtype, torch.float32):
            raise TypeError(
                f"{name} must have the dtype of hidden_states ({hidden_states.dtype}) or float32 "
                f"(master weights), got {w.dtype}"
            )

    # shapes
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be [T, H], got shape {tuple(hidden_states.shape)}")
    T, H = hidden_states.shape
    if top_k_index.dim() != 2 or top_k_index.shape[0] != T:
        raise ValueError(f"top_k_index must be [T, top_k] with T = {T}, got shape {tuple(top_k_index.shape)}")
    if top_k_index.numel() >= 2**31:
        raise ValueError(
            f"top_k_index must hold fewer than 2**31 slots (T * top_k), got {top_k_index.numel()}"
        )
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"top_k_weights must have the shape of top_k_index {tuple(top_k_index.shape)}, "
            f"got {tuple(top_k_weights.shape)}"
        )
    if gate_up_proj.dim() != 3:
        raise ValueError(f"gate_up_proj must be [E, 2I, H], got shape {tuple(gate_up_proj.shape)}")
    if down_proj.dim() != 3:
        raise ValueError(f"down_proj must be [E, H, I], got shape {tuple(down_proj.shape)}")
    if H < 1:
        raise ValueError(
            f"hidden_states must have a hidden size H >= 1, got shape {tuple(hidden_states.shape)}"
        )
    E, two_I, H1 = gate_up_proj.shape
    if E < 1:
        raise ValueError(f"gate_up_proj must hold at least one expert, got shape {tuple(gate_up_proj.shape)}")
    if E > MAX_EXPERTS:
        raise ValueError(f"at most {MAX_EXPERTS} experts are supported, gate_up_proj has {E}")
    if H1 != H:
        raise ValueError(
            f"gate_up_proj.shape[2] must equal the hidden size H = {H} of hidden_states, got {H1}"
        )
    if down_proj.shape[0] != E:
        raise ValueError(
            f"down_proj.shape[0] must equal the number of experts E = {E} of gate_up_proj, got {down_proj.shape[0]}"
        )
    if down_proj.shape[1] != H:
        raise ValueError(
            f"down_proj.shape[1] must equal the hidden size H = {H} of hidden_states, got {down_proj.shape[1]}"
        )
    if two_I != 2 * down_proj.shape[2] or two_I == 0:
        raise ValueError(
            f"gate_up_proj.shape[1] must be 2 * down_proj.shape[2] = 2I (I >= 1), "
            f"got {two_I} and I = {down_proj.shape[2]}"
        )

    # devices
    device = hidden_states.device
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(
                f"{name} is on {t.device}, but hidden_states is on {device}: put all tensors on one device"
            )

    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and not (device.type == "cpu" and triton_interpreting()):
        raise ValueError(
            f"backend='triton' needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before "
            f"sonar_kernels is imported; got tensors on {device}. Use backend='torch' or 'auto'."
        )
    return backend


def _input_precision(dtype: torch.dtype) -> str:
    # Full fp32 products for fp32 GEMMs: the GPU would otherwise silently use tf32 (DESIGN.md).
    return "ieee" if dtype == torch.float32 else "tf32"


def routing_block_config(num_experts: int) -> dict:
    """BLOCK_E covers all experts; BLOCK_S keeps the [BLOCK_S, BLOCK_E] one-hot tile at 8192 elements."""
    block_e = max(16, triton.next_power_of_2(num_experts))
    return {"BLOCK_E": block_e, "BLOCK_S": max(8, 8192 // block_e), "num_warps": 4}


def routing_metadata(top_k_index: torch.Tensor, num_experts: int) -> RoutingMetadata:
    """Routing metadata on the device in one launch (see :class:`sonar_kernels.reference.RoutingMetadata`).

    Args:
        top_k_index: [T, top_k] int32/int64 expert ids, any strides; ids outside [0, E) are dropped.
        num_experts: E, 1 <= E <= 1024.
    Returns:
        RoutingMetadata with ``tile_offsets`` for row tiles of ``TILE_M`` rows. The tails of
        ``token_of_row`` and ``slot_of_row`` (rows >= expert_offsets[E]) are left unwritten.
    """
    T, top_k = top_k_index.shape
    S = T * top_k
    device = top_k_index.device
    meta = RoutingMetadata(
        expert_offsets=_empty((num_experts + 1,), torch.int32, device),
        tile_offsets=_empty((num_experts + 1,), torch.int32, device),
        row_of_slot=_empty((S,), torch.int32, device),
        token_of_row=_empty((S,), torch.int32, device),
        slot_of_row=_empty((S,), torch.int32, device),
    )
    cfg = routing_block_config(num_experts)
    with _on_device(device):
        _routing_metadata_kernel[(1,)](
            top_k_index, meta.expert_offsets, meta.tile_offsets, meta.row_of_slot, meta.token_of_row,
            meta.slot_of_row,
            S, num_experts, top_k,
            top_k_index.stride(0), top_k_index.stride(1),
            TILE_M=TILE_M, BLOCK_S=cfg["BLOCK_S"], BLOCK_E=cfg["BLOCK_E"], num_warps=cfg["num_warps"],
        )  # fmt: skip
    return meta


def _on_device(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def moe_mlp_fwd(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, RoutingMetadata]:
    """Triton forward of the gated expert MLP; arguments as checked by :func:`check_moe_mlp_args`.

    Four launches: routing metadata, up-projection + GLU, down-projection, combine. Any strides.
    Returns:
        (out [T, H] in the dtype of hidden_states, Hpre [S, 2I] in that dtype (rows past
        expert_offsets[E] unwritten), the routing metadata).
    """
    with _on_device(hidden_states.device):
        return _moe_mlp_fwd(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation)


def _moe_mlp_fwd(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation):
    T, H = hidden_states.shape
    top_k = top_k_index.shape[1]
    E, two_I, _ = gate_up_proj.shape
    I = two_I // 2
    S = T * top_k
    dtype = hidden_states.dtype
    device = hidden_states.device
    interpret = triton_interpreting()
    out = _empty((T, H), dtype, device)
    meta = routing_metadata(top_k_index, E)
    hpre = _empty((S, two_I), dtype, device)
    if S == 0:
        return out.zero_(), hpre, meta

    cfg = FWD_GEMM_CONFIG
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    launch = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    # Row tiles: sum_e ceil(rows_e / BLOCK_M) <= cdiv(S, BLOCK_M) + min(E, S); extra programs exit.
    max_row_tiles = triton.cdiv(S, block_m) + min(E, S)
    precision = _input_precision(dtype)

    a = _empty((S, I), dtype, device)
    _expert_mlp_fwd_up_kernel[(max_row_tiles * triton.cdiv(I, block_n),)](
        hidden_states, gate_up_proj, meta.token_of_row, meta.expert_offsets, meta.tile_offsets, hpre, a,
        E, H, I,
        hidden_states.stride(0), hidden_states.stride(1),
        gate_up_proj.stride(0), gate_up_proj.stride(1), gate_up_proj.stride(2),
        hpre.stride(0), hpre.stride(1), a.stride(0), a.stride(1),
        ACTIVATION=activation, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        INPUT_PRECISION=precision, INTERPRET=interpret, **launch,
    )  # fmt: skip

    y = _empty((S, H), dtype, device)
    _expert_mlp_fwd_down_kernel[(max_row_tiles * triton.cdiv(H, block_n),)](
        a, down_proj, meta.expert_offsets, meta.tile_offsets, y,
        E, H, I,
        a.stride(0), a.stride(1),
        down_proj.stride(0), down_proj.stride(1), down_proj.stride(2),
        y.stride(0), y.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        INPUT_PRECISION=precision, INTERPRET=interpret, **launch,
    )  # fmt: skip
    del a

    cc = COMBINE_CONFIG
    _expert_mlp_fwd_combine_kernel[(triton.cdiv(T, cc["BLOCK_M"]), triton.cdiv(H, cc["BLOCK_N"]))](
        y, meta.row_of_slot, top_k_weights, out,
        T, H, top_k,
        y.stride(0), y.stride(1), top_k_weights.stride(0), top_k_weights.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_M=cc["BLOCK_M"], BLOCK_N=cc["BLOCK_N"], INTERPRET=interpret, num_warps=cc["num_warps"],
    )  # fmt: skip
    return out, hpre, meta
