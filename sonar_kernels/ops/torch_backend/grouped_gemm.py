"""Grouped GEMMs of the torch backend over experts' rows: ``torch._grouped_mm`` (one call over all experts,
no host sync) where this torch's grouped GEMM takes the device, dtype and strides (it needs 16-byte aligned
strides; probed once per device and dtype), else one ``torch.mm`` per expert over host row offsets (one
host read of E + 1 integers per call). Both give the same bits on the CPU, where torch's grouped GEMM runs
one ``mm`` per group."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch's ``_grouped_mm`` runs on ``device_type`` in ``dtype`` (probed once)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.zeros(8, 8, dtype=dtype, device=device_type)
        b = torch.zeros(2, 8, 8, dtype=dtype, device=device_type)
        torch._grouped_mm(a, b, offs=torch.tensor([4, 8], dtype=torch.int32, device=device_type))
        torch._grouped_mm(a.t(), a, offs=torch.tensor([4, 8], dtype=torch.int32, device=device_type))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _aligned(*tensors: torch.Tensor) -> bool:
    """torch._grouped_mm's layout rule: every stride but the unit one, and the start, 16-byte aligned."""
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16:
            return False
        if any(stride != 1 and (stride * size) % 16 for stride in t.stride()):
            return False
    return True


def uses_grouped_mm(*tensors: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these operands here (its device and dtype, its stride rule)."""
    t = tensors[0]
    return _grouped_mm_runs(t.device.type, t.dtype) and _aligned(*tensors)


def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
    """out[r] = rows[r] @ weight[e(r)] for the rows of each expert: [S, K] x [E, K, N] -> [S, N] in the
    dtype of ``rows``. Rows past ``expert_offsets[E]`` are left unspecified (mask them)."""
    if uses_grouped_mm(rows, weight):
        return torch._grouped_mm(rows, weight, offs=expert_offsets[1:])
    out = torch.zeros(rows.shape[0], weight.shape[2], dtype=rows.dtype, device=rows.device)
    bounds = expert_offsets.tolist()  # host read: the fallback only
    for e in range(weight.shape[0]):
        start, end = bounds[e], bounds[e + 1]
        if end > start:
            torch.mm(rows[start:end], weight[e], out=out[start:end])
    return out


def grouped_wgrad(p: torch.Tensor, q: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
    """dW[e] = sum over the rows r of expert e of p[r]^T q[r]: [S, M] x [S, N] -> [E, M, N] in the dtype
    of ``p``; an expert without rows gets zeros. Rows past ``expert_offsets[E]`` are not read."""
    E = expert_offsets.shape[0] - 1
    pt = p.t()
    if uses_grouped_mm(pt, q):
        return torch._grouped_mm(pt, q, offs=expert_offsets[1:])
    out = torch.zeros(E, p.shape[1], q.shape[1], dtype=p.dtype, device=p.device)
    bounds = expert_offsets.tolist()  # host read: the fallback only
    for e in range(E):
        start, end = bounds[e], bounds[e + 1]
        if end > start:
            torch.mm(pt[:, start:end], q[start:end], out=out[e])
    return out
