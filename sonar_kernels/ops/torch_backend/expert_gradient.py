"""The torch backend's expert weight gradient (dW[e] = sum_r P[r]^T Q[r] over expert e's rows), computed
whole or a range of experts at a time: the CPU counterpart of the Triton wgrad launch, which the torch
backend's in-backward update consumes chunk by chunk (``sonar_kernels.ops.torch_backend.adamw.torch_adamw_chunked_``;
docs/design.md, "Which AdamW runs where") and the plain backward whole. ``Gathered`` operands (rows of a
token tensor gathered per chunk) keep the [S, H] operands from existing."""

from __future__ import annotations

import itertools
import math

import torch

from sonar_kernels.ops.common import inf_norm
from sonar_kernels.ops.torch_backend.grouped_gemm import grouped_wgrad
from sonar_kernels.specs import RoutingMetadata

# Chunk boundaries fall on multiples of this many elements of the weight: torch's fused CPU AdamW splits
# its work at 64-byte cache lines and runs a scalar loop on what is left of a call, whose arithmetic
# differs from its vector loop in the last bit; a chunk boundary on a multiple of 64 elements is a
# multiple of every vector length (fp64 to fp16, 512-bit vectors), so a chunked update is bit for bit the
# update of the whole tensor.
CHUNK_ALIGN = 64


class Gathered:
    """Rows of a GEMM operand gathered from tokens on request: row r is ``source[index[r]]``, times
    ``scale[r]`` in fp32 when given, in ``dtype``. The wgrad reads a chunk's rows into a reused buffer (the
    CPU), so no [S, H] operand outlives its chunk; :meth:`full` builds it where one grouped GEMM reads it
    (a GPU)."""

    def __init__(self, source, index, dtype, scale=None):
        self.source, self.index, self.dtype, self.scale = source, index, dtype, scale
        self.shape = (index.shape[0], source.shape[1])

    def rows(self, start: int, end: int, buffer: torch.Tensor) -> torch.Tensor:
        """Rows ``start`` to ``end - 1`` (``buffer``: at least that many rows, ``dtype``, contiguous)."""
        index = self.index[start:end]
        if self.source.dtype == self.dtype and (self.scale is None or self.dtype == torch.float32):
            rows = torch.index_select(self.source, 0, index, out=buffer[: end - start])
            return rows if self.scale is None else rows.mul_(self.scale[start:end, None])
        rows = torch.index_select(self.source, 0, index).float()
        if self.scale is not None:
            rows.mul_(self.scale[start:end, None])
        return buffer[: end - start].copy_(rows)

    def full(self) -> torch.Tensor:
        return self.rows(
            0, self.shape[0], torch.empty(self.shape, dtype=self.dtype, device=self.source.device)
        )

    def inf_norm(self) -> torch.Tensor:
        """An upper bound of the largest |row entry|: max |source| (times max |scale|)."""
        bound = inf_norm(self.source)
        return bound if self.scale is None else bound * inf_norm(self.scale)


def _rows_of(operand, start: int, end: int, buffers: dict) -> torch.Tensor:
    """Rows ``start`` to ``end - 1`` of a GEMM operand: a slice of a tensor, or a :class:`Gathered`
    operand's rows in a buffer kept in ``buffers`` (one per operand, grown to the most rows asked for)."""
    if isinstance(operand, torch.Tensor):
        return operand[start:end]
    buffer = buffers.get(id(operand))
    if buffer is None or buffer.shape[0] < end - start:
        buffer = torch.empty(end - start, operand.shape[1], dtype=operand.dtype, device=operand.source.device)
        buffers[id(operand)] = buffer
    return operand.rows(start, end, buffer)


class ExpertGradient:
    """The gradient of one expert tensor, computed for a range of experts on request: the torch
    backend's counterpart of the Triton wgrad launch, which the in-backward update consumes chunk by
    chunk (:func:`sonar_kernels.ops.torch_backend.adamw.torch_adamw_chunked_`) and the plain backward whole.

    Each expert's gradient is one ``torch.mm`` per part over its rows (dW[e] = sum_r P[r]^T Q[r]),
    computed in the operands' dtype and stored in the weight's dtype and layout; the same GEMMs whatever
    the chunks, so a chunked gradient is bit for bit the whole one. Rows past ``expert_offsets[E]`` are
    not read. The expert offsets are read on the host once (free on the CPU; on a GPU the whole-layer
    path, :meth:`full`, uses torch's grouped GEMM without a host read).

    Args:
        weight: the expert tensor [E, ...] (its gradient has its shape, dtype and strides).
        operands: a function of no arguments returning the parts, each (P [S, m], Q [S, n], dest) with
            dest(t) mapping a tensor of the weight's shape (sliced along experts) to its [e, m, n] view
            that receives sum_r P^T Q; P and Q each a tensor or a :class:`Gathered` operand; called once,
            when a gradient is first asked for.
        expert_offsets: [E + 1] int32, the routing metadata's.
        whole: when given, a function of no arguments returning the whole gradient, used instead of the
            parts (the biases: tiny, never chunked).
    """

    def __init__(self, weight, operands, expert_offsets, whole=None):
        self.weight, self._operands, self._parts, self._whole = weight, operands, None, whole
        self.expert_offsets = expert_offsets
        self._bounds = None
        self._buffers = {}  # the gathered operands' row buffers
        self.num_experts = weight.shape[0]

    def __call__(self) -> torch.Tensor:
        return self.full()

    @property
    def chunkable(self) -> bool:
        """Whether the gradient can be computed per range of experts (not for the biases, not on a GPU)."""
        return (
            self._whole is None
            and self.weight.device.type == "cpu"
            and not callable(getattr(self.weight, "full_tensor", None))  # not a DTensor's shard
        )

    def parts(self):
        if self._parts is None:
            self._parts = self._operands()
            self._operands = None
        return self._parts

    def _row_bounds(self) -> list[int]:
        if self._bounds is None:
            self._bounds = self.expert_offsets.tolist()  # host read: the CPU only (see chunkable)
        return self._bounds

    def full(self) -> torch.Tensor:
        """The whole gradient: the weight's shape, dtype and strides."""
        if self._whole is not None:
            return self._whole()
        grad = torch.empty_like(self.weight)
        if self.chunkable:
            return self.compute(0, self.num_experts, grad)
        for p, q, dest in self.parts():  # a GPU: one grouped GEMM per part, no host read
            p, q = (t if isinstance(t, torch.Tensor) else t.full() for t in (p, q))
            dest(grad).copy_(grouped_wgrad(p, q, self.expert_offsets))
        return grad

    def compute(self, first: int, last: int, out: torch.Tensor) -> torch.Tensor:
        """The gradient of experts ``first`` to ``last - 1`` into ``out`` (the shape, dtype and strides
        of ``weight[first:last]``); returns ``out``."""
        bounds = self._row_bounds()
        base = bounds[first]
        for p, q, dest in self.parts():
            target = dest(out)
            # The chunk's rows (its experts' rows are contiguous), gathered once per chunk and operand.
            p_rows = _rows_of(p, base, bounds[last], self._buffers)
            q_rows = _rows_of(q, base, bounds[last], self._buffers)
            for j, e in enumerate(range(first, last)):
                start, end = bounds[e] - base, bounds[e + 1] - base
                if end <= start:
                    target[j].zero_()
                elif target.dtype == p_rows.dtype:
                    torch.mm(p_rows[start:end].t(), q_rows[start:end], out=target[j])
                else:  # rounded to the operands' dtype first, as the GEMM of the Triton kernels is
                    target[j].copy_(torch.mm(p_rows[start:end].t(), q_rows[start:end]))
        return out

    def bound(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(largest |P|, largest |Q|, most rows of an expert): what
        :func:`sonar_kernels.ops.arithmetic.overflow_possible` bounds the gradient's entries by."""
        bounds = self._row_bounds()
        most_rows = max((b - a for a, b in itertools.pairwise(bounds)), default=0)

        def largest(t):
            return inf_norm(t[: bounds[-1]]) if isinstance(t, torch.Tensor) else t.inf_norm()

        p_max = torch.stack([largest(p) for p, _, _ in self.parts()]).amax()
        q_max = torch.stack([largest(q) for _, q, _ in self.parts()]).amax()
        return p_max, q_max, most_rows

    def chunks(self, budget_bytes: int | None) -> list[tuple[int, int]]:
        """(first, last) expert ranges of at most ``budget_bytes`` of gradient each (at least one expert;
        grown to the next boundary on a multiple of :data:`CHUNK_ALIGN` elements), in order; one range
        over all experts when ``budget_bytes`` is None or the gradient is not chunkable."""
        if not self.chunkable:
            return [(0, self.num_experts)]
        return expert_chunks(tuple(self.weight.shape), self.weight.element_size(), budget_bytes)


def expert_chunks(
    shape: tuple[int, ...], element_size: int, budget_bytes: int | None
) -> list[tuple[int, int]]:
    """The torch backend's chunk geometry: (first, last) ranges of the experts of a tensor of ``shape``
    [E, ...] with ``element_size`` bytes an element, each at most ``budget_bytes`` (at least one expert;
    grown to the next boundary on a multiple of :data:`CHUNK_ALIGN` elements), in order; one range over
    all experts when ``budget_bytes`` is None. :meth:`ExpertGradient.chunks`, and sonar-train's bitwise
    controls, which sum a gradient's norm in the same chunks (``train/clipping.py``)."""
    E = shape[0]
    if budget_bytes is None or E == 0:
        return [(0, E)]
    per_expert = math.prod(shape[1:])
    size = max(1, budget_bytes // max(per_expert * element_size, 1))
    step = CHUNK_ALIGN // math.gcd(per_expert, CHUNK_ALIGN)  # experts per aligned boundary
    size = -(-size // step) * step
    return [(first, min(first + size, E)) for first in range(0, E, size)]


def valid_rows(meta: RoutingMetadata, S: int) -> torch.Tensor:
    """[S, 1] bool: rows that belong to an expert (before ``expert_offsets[E]``)."""
    return (torch.arange(S, device=meta.expert_offsets.device) < meta.expert_offsets[-1])[:, None]


def row_weights(top_k_weights, meta) -> torch.Tensor:
    """[S] float32: each row's routing weight (0 past expert_offsets[E], the dropped slots)."""
    valid = valid_rows(meta, top_k_weights.numel())
    return torch.where(valid[:, 0], top_k_weights.reshape(-1)[meta.slot_of_row.long()].float(), 0.0)
