"""Run a function on several gloo ranks (CPU processes, start method "spawn") with hard timeouts.

Import-safe: spawned ranks import the test module that defines the function, so test modules keep their
work inside functions. Each rank runs with one intra-op thread (2 cores, up to 4 ranks).
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Every collective fails after this long instead of hanging.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(rank: int, world_size: int, port: int) -> None:
    """The default process group (gloo, TCP on localhost) with the short collective timeout."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )


def _entry(rank: int, fn, world_size: int, port: int, args: tuple, initialize: bool) -> None:
    torch.set_num_threads(1)
    try:
        if initialize:
            init(rank, world_size, port)
        fn(rank, world_size, *args) if initialize else fn(rank, world_size, port, *args)
    finally:
        gc.collect()  # DDP's and the optimizers' reference cycles let go of the group's work first
        if dist.is_initialized():
            dist.destroy_process_group()
    # The results are on disk: leave without interpreter finalization, during which gloo's worker threads
    # can abort the process ("terminate called without an active exception", pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(fn, world_size: int, *args, timeout: float = 120, initialize: bool = True) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks with the default process group
    initialized (``initialize=False``: ``fn(rank, world_size, port, *args)``, which calls :func:`init`
    itself). Raises the first rank's exception, or TimeoutError after ``timeout`` seconds (all ranks are
    killed)."""
    port = free_port()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    context = mp.start_processes(
        _entry,
        args=(fn, world_size, port, args, initialize),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {world_size} ranks ran past {timeout} s")
