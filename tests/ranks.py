"""Run a function on several gloo ranks (CPU processes, start method "spawn") with hard timeouts.

Import-safe: spawned ranks import the test module that defines the function, so test modules keep their
work inside functions. Each rank runs with one intra-op thread (2 cores, up to 4 ranks).

The ranks are a pool of spawned processes that a test process keeps for its session, one per rank of the
widest run so far: each run gets a new process group (its own port), destroyed after the run, so a run
does not pay a fresh interpreter's imports per rank (about 2.7 CPU-seconds each on a 2-core CPU). A run
that fails, crashes or times out kills the whole pool, and the next run spawns a fresh one: nothing of a
failed run survives into another test.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import socket
import sys
import time
import traceback
from multiprocessing.connection import wait

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


def _serve(conn) -> None:
    """A pooled rank: runs the jobs it receives until its test process closes the pipe (or sends None),
    answering each with None or the traceback of what it raised."""
    torch.set_num_threads(1)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):  # the test process is gone
            job = None
        if job is None:
            break
        fn, rank, world_size, port, args, initialize = job
        error = None
        try:
            if initialize:
                init(rank, world_size, port)
            fn(rank, world_size, *args) if initialize else fn(rank, world_size, port, *args)
        except BaseException:
            error = traceback.format_exc()
        try:
            gc.collect()  # DDP's and the optimizers' reference cycles let go of the group's work first
            if dist.is_initialized():
                dist.destroy_process_group()
        except BaseException:
            error = (error or "") + traceback.format_exc()
        conn.send(error)
    # Leave without interpreter finalization, during which gloo's worker threads can abort the process
    # ("terminate called without an active exception", pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


_pool: list[tuple[mp.Process, object]] = []


def _workers(count: int) -> list:
    context = mp.get_context("spawn")
    while len(_pool) < count:
        here, there = context.Pipe()
        process = context.Process(target=_serve, args=(there,), name=f"rank-{len(_pool)}")
        process.start()
        there.close()
        _pool.append((process, here))
    return _pool[:count]


@atexit.register
def _kill_pool() -> None:
    for process, conn in _pool:
        process.kill()
        process.join()
        conn.close()
    _pool.clear()


def run(fn, world_size: int, *args, timeout: float = 120, initialize: bool = True) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` ranks with the default process group
    initialized (``initialize=False``: ``fn(rank, world_size, port, *args)``, which calls :func:`init`
    itself). Raises RuntimeError with the first failing rank's traceback (or its exit code), or
    TimeoutError after ``timeout`` seconds; either way every rank is killed."""
    name = getattr(fn, "__name__", fn)
    port = free_port()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        workers = _workers(world_size)
        for rank, (_, conn) in enumerate(workers):
            conn.send((fn, rank, world_size, port, args, initialize))
        pending = dict(enumerate(workers))
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{name} on {world_size} ranks ran past {timeout} s")
            waitables = [w for process, conn in pending.values() for w in (conn, process.sentinel)]
            wait(waitables, timeout=left)
            for rank, (process, conn) in list(pending.items()):
                if conn.poll():
                    error = conn.recv()
                    if error is not None:
                        raise RuntimeError(f"rank {rank} of {world_size} failed in {name}:\n{error}")
                    del pending[rank]
                elif not process.is_alive():
                    raise RuntimeError(
                        f"rank {rank} of {world_size} exited in {name} (exit code {process.exitcode})"
                    )
    except BaseException:
        _kill_pool()
        raise
