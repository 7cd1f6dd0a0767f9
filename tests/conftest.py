"""Test set-up: the Triton interpreter on CPU-only machines, NaN-filled launcher buffers, seeding."""

import datetime
import os
import socket

# pytest-xdist workers (`make test` runs one per core) and the gloo ranks the tests spawn share the
# cores: OpenMP threads that wait passively instead of spinning leave them to the other processes (the
# thread count, which decides how torch splits its sums, stays torch's default).
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

# Triton reads TRITON_INTERPRET when the kernels are decorated, so it must be set before any import of
# sonar_kernels. On a machine with CUDA the kernels run compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from sonar_kernels import ops

# An int buffer element that a kernel never wrote reads as this.
UNWRITTEN_INT = -(2**30)


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    """Every buffer a launcher allocates starts as NaN (floating) or UNWRITTEN_INT (integer)."""

    def poisoned_empty(shape, dtype, device):
        fill = float("nan") if dtype.is_floating_point else UNWRITTEN_INT
        return torch.full(shape, fill, dtype=dtype, device=device)

    monkeypatch.setattr(ops.common, "empty", poisoned_empty)


@pytest.fixture
def device():
    """Where the Triton backend runs: CUDA when present (compiled kernels), else CPU (interpreter)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_rank_mesh():
    """A one-rank gloo process group (a free port, a short timeout) and its CPU DeviceMesh, destroyed after
    the test."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=20))
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def wgrad_tiles_of_the_8bit_update():
    """Every wgrad launch on the tiles of the 8-bit update's (and bf16 master weights') fused epilogue
    (ops.triton_backend.configs.WGRAD_8BIT), for tests whose reference feeds a plain gradient to the scheme's torch ops:
    "the same gradient" needs the same tiles, since two tile shapes may sum a GEMM in different orders
    (numpy's matmul under the interpreter does on some CPUs, as a GPU's MMA may)."""
    from sonar_kernels.ops.triton_backend import configs

    configs.pin("wgrad", configs.WGRAD_8BIT)
    try:
        yield
    finally:
        configs.pin("wgrad", None)
