"""What every launcher shares: buffer allocation, the device context, the interpreter test, layouts."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake

from sonar_kernels.kernels.expert_mlp_fwd import TILE_M
from sonar_kernels.specs import RoutingMetadata, gate_up_view, is_separate

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def triton_interpreting() -> bool:
    """True when the Triton kernels run under the interpreter (TRITON_INTERPRET=1 before import)."""
    from triton.runtime.interpreter import InterpretedFunction

    from sonar_kernels.kernels import routing

    return isinstance(routing.routing_histogram_kernel, InterpretedFunction)


def empty(shape, dtype, device) -> torch.Tensor:
    """Every buffer a launcher allocates comes from here (the tests fill it with NaN to catch unwritten
    data: they replace this function)."""
    return torch.empty(shape, dtype=dtype, device=device)


def on_device(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def input_precision(dtype: torch.dtype) -> str:
    """Full fp32 products for fp32 GEMMs: the GPU would otherwise silently use tf32 (docs/design.md)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def max_row_tiles(S: int, E: int, block_m: int) -> int:
    """Grid rows of a grouped GEMM without a host sync: sum_e ceil(rows_e / block_m) <= cdiv(S, block_m)
    + min(E, S); the programs past tile_offsets[E] exit at once."""
    return triton.cdiv(S, block_m) + min(E, S)


def tile_offsets_for(meta: RoutingMetadata, block_m: int) -> torch.Tensor:
    """[E + 1] int32: the exclusive prefix sum of ceil(rows of e / ``block_m``), the row tiles of a grouped
    GEMM launched with BLOCK_M = ``block_m`` (``meta.tile_offsets`` itself for the routing metadata's
    TILE_M); on the device, no host sync."""
    if block_m == TILE_M:
        return meta.tile_offsets
    counts = meta.expert_offsets[1:] - meta.expert_offsets[:-1]
    tiles = torch.div(counts + (block_m - 1), block_m, rounding_mode="floor")
    out = torch.zeros_like(meta.expert_offsets)
    out[1:] = torch.cumsum(tiles, 0, dtype=torch.int32)
    return out


def is_dense(t: torch.Tensor) -> bool:
    """True when ``t`` covers exactly ``numel`` storage elements from its first (no gaps, no overlap)."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def laid_out_like(t, weight: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor with the shape, strides and device of ``weight`` (a kernel walks both
    with the same offsets)."""
    return (
        isinstance(t, torch.Tensor)
        and t.shape == weight.shape
        and t.stride() == weight.stride()
        and t.device == weight.device
    )


def like(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An unfilled tensor with the shape of ``weight`` and, when it is dense, its strides."""
    if not is_dense(weight):
        return empty(weight.shape, dtype, weight.device)
    return empty((weight.numel(),), dtype, weight.device).as_strided(weight.shape, weight.stride())


def inf_norm(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-dim float32 tensor (NaN when x holds a NaN; 0 for an empty x).

    From ``torch.aminmax`` (one vectorized pass, no temporary; torch's ``vector_norm(x, inf)`` is tens of
    times slower on the CPU), except for a DTensor (a sharded gradient), whose ``vector_norm`` torch
    reduces over the mesh."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    if callable(getattr(x, "full_tensor", None)):
        return torch.linalg.vector_norm(x, float("inf")).float()
    low, high = torch.aminmax(x)
    return torch.maximum(high, -low).abs().float()  # abs: -0.0 for all-zero x


def skip_decided(grad: torch.Tensor, norm: torch.Tensor, limit: float) -> torch.Tensor:
    """The update's skip, ``~(whole(inf_norm(grad)) <= limit)`` (0-dim bool), read from ``norm`` where that
    decides it: ``norm`` is ``grad``'s fp32 2-norm made whole (``torch.linalg.vector_norm``, over the mesh
    for a DTensor), a rounded sum of squares, and a rounded sum of non-negative terms never falls below its
    largest term (each rounded addition is monotone), nor its square root below the largest magnitude: a
    norm below ``limit`` (a power of two, so an entry beyond it has a square at or above ``limit ** 2``)
    that is not NaN means every entry is finite and within ``limit``, and no pass over ``grad`` is needed.
    Read on the host, so on the CPU only (free there; a norm of ``limit`` or more, inf or NaN, any other
    device, and a fake tensor, which has no value to read (a memory trace: the pass a GPU takes), take the
    pass over ``grad``). The same on every rank of a mesh (``norm`` is)."""
    if norm.device.type == "cpu" and not is_fake(norm) and bool(norm < limit):
        return torch.zeros((), dtype=torch.bool)
    return ~(whole(inf_norm(grad)) <= limit)


def whole(t: torch.Tensor) -> torch.Tensor:
    """A reduction's result as a plain tensor: a DTensor's (a sharded or replicated parameter's) is made
    whole over its mesh (the collective its placement needs); any other tensor is returned as it is."""
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else t


class GateUpOperand(NamedTuple):
    """W1 as the Triton kernels read it: [E, 2, I, H] (half 0 the gate, half 1 the up projection; one
    half without a gate) through four element strides, from the element at ``base``'s pointer.

    Attributes:
        base: a view of W1 whose first element is that of expert 0, half 0 (the gate tensor itself in a
            separate layout), [E, halves of this tensor, I, H].
        strides: (expert, half, row of a half, column), in elements. A separate layout's half stride is
            the distance from the gate tensor to the up tensor in elements (the two tensors share their
            strides), so one pointer and four strides address both, as they do one tensor's halves.
        halves: 2, or 1 without a gate.
        I: the rows of one half.
    """

    base: torch.Tensor
    strides: tuple[int, int, int, int]
    halves: int
    I: int


def gate_up_operand(
    gate_up_proj: torch.Tensor, layout: str, up_proj: torch.Tensor | None = None
) -> GateUpOperand:
    """W1 of ``layout`` (:data:`sonar_kernels.specs.LAYOUTS`; ``up_proj`` the up tensor of a separate
    layout, which ``check_moe_mlp_args`` checked to share gate_up_proj's dtype, shape and strides) as the
    kernels read it. A view, never a copy.

    Raises:
        ValueError: the two tensors of a separate layout start a fractional number of elements apart."""
    w1 = gate_up_view(gate_up_proj, layout)
    if not is_separate(layout):
        return GateUpOperand(w1, tuple(w1.stride()), w1.shape[1], w1.shape[2])
    distance = up_proj.data_ptr() - w1.data_ptr()
    if distance % w1.element_size():
        raise ValueError("up_proj and gate_up_proj must start a whole number of elements apart in memory")
    half_stride = distance // w1.element_size()
    return GateUpOperand(w1, (w1.stride(0), half_stride, w1.stride(2), w1.stride(3)), 2, w1.shape[2])
