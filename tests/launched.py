"""Scripts launched in their own processes (one, or several ranks through torchrun on gloo) by the tests of
the training stacks, and the comparison of the parameters two runs saved."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ranks
import torch

ROOT = Path(__file__).resolve().parents[1]


def run(
    script: Path, args: list[str], processes: int = 1, timeout: int = 240, env: dict | None = None
) -> str:
    """Run ``script`` with ``args`` in a fresh interpreter, on ``processes`` torchrun ranks when more than
    one; assert it exited 0 and return its stdout and stderr."""
    launch = [
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(processes),
        "--master-port",
        str(ranks.free_port()),
    ]
    done = subprocess.run(
        [sys.executable, *(launch if processes > 1 else []), str(script), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
        env=os.environ | {"OMP_NUM_THREADS": "1"} | (env or {}),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def assert_bitwise_and_trained(sonar: Path, standard: Path, expert: str, count: int = 25) -> None:
    """The parameters saved at ``sonar`` and ``standard`` (name -> tensor) are the same ``count`` tensors,
    bit for bit, and the expert tensor ``expert`` moved from the tiny OLMoE's initial weights (equal
    unchanged weights would prove nothing)."""
    a, b = torch.load(sonar), torch.load(standard)
    assert a.keys() == b.keys() and len(a) == count
    for name, p in a.items():
        assert torch.equal(p, b[name]), name
    sys.path.insert(0, str(ROOT / "examples"))
    from trainer_data_parallel import tiny_olmoe

    initial = dict(tiny_olmoe().named_parameters())
    assert not torch.equal(initial[expert].detach(), a[expert])


def assert_refused_unchanged(folder: Path, name: str, ranks: int, kind: str, parts) -> None:
    """Every rank of a run saved ``{name}-{rank}.pt`` with no parameter changed and the refusal it caught,
    of type ``kind``, whose message holds each of ``parts``."""
    for rank in range(ranks):
        saved = torch.load(folder / f"{name}-{rank}.pt")
        assert saved["changed"] == [], (rank, saved["changed"])
        refused, message = saved["refusal"]
        assert refused == kind, (rank, refused, message)
        for part in parts:
            assert part in message, (part, message)
