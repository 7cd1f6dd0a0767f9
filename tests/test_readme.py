"""Every ```python block of README.md and of docs/*.md runs as written, each in a fresh process (issue 16,
the newcomer's path). A block whose first line is ``# torchrun --nproc-per-node N ...`` is a script for N processes: it
runs under ``python -m torch.distributed.run`` (gloo on the CPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import ranks
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
# README's two quick starts; docs/usage.md's "Use" block; docs/distributed.md's data-parallel and EP x FSDP2
# scripts.
EXPECTED_BLOCKS = 5
# Each block takes a few seconds on a 2-core CPU (most of it importing torch and transformers).
BLOCK_TIMEOUT = 90
# torch 2.13's gloo can abort a rank at interpreter exit, after the script has run to its end: "terminate
# called without an active exception" (a gloo worker thread releases a tensor while Python finalizes;
# pytorch/pytorch#179291, the abort tests/ranks.py avoids with os._exit). Measured on this CPU: 2 runs in
# 40 of a plain DDP script without sonar_kernels, 3 in 105 of the README's. Such a run is repeated,
# ATTEMPTS in all; a rank that raises prints "[rankN]: Traceback" and is never repeated.
ATTEMPTS = 3
EXIT_ABORT = "terminate called without an active exception"
TORCHRUN = re.compile(r"#\s*torchrun\s+--nproc-per-node[ =](\d+)\b")
FENCE = re.compile(r"^([ \t]*)```python[ \t]*$")


def python_blocks(text: str, name: str = "README.md") -> list[tuple[int, str]]:
    """(line number of the opening fence, dedented code) of every fenced ```python block, those indented
    inside list items included (closed by a fence at the same indentation)."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, start = opening.group(1), i
        i += 1
        while i < len(lines) and lines[i].rstrip() != indent + "```":
            i += 1
        if i == len(lines):
            raise ValueError(f"{name}:{start + 1}: the ```python block is never closed")
        blocks.append((start + 1, textwrap.dedent("\n".join(lines[start + 1 : i])) + "\n"))
        i += 1
    return blocks


BLOCKS = [
    (f"{path.relative_to(ROOT)}:{line}", code)
    for path in DOCS
    for line, code in python_blocks(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
]


def test_the_readme_and_docs_have_their_python_blocks():
    assert len(BLOCKS) >= EXPECTED_BLOCKS, [where for where, _ in BLOCKS]
    assert sum(where.startswith("README.md:") for where, _ in BLOCKS) >= 2, "the README's quick starts"


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_block(code: str, workdir: Path, timeout: float = BLOCK_TIMEOUT) -> subprocess.CompletedProcess:
    """Run one block in a fresh process in ``workdir``: ``python -c`` or, for a torchrun script, the file
    under ``python -m torch.distributed.run`` on a free port (repeated after gloo's abort at exit)."""
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    if (launch := TORCHRUN.match(first)) is None:
        return subprocess.run(
            [sys.executable, "-c", code], cwd=workdir, env=_environment(), capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip
    script = workdir / "readme_block.py"
    script.write_text(code, encoding="utf-8")
    for _ in range(ATTEMPTS):
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", launch.group(1),
             "--master-port", str(ranks.free_port()), str(script)],
            cwd=workdir, env=_environment(), capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if done.returncode == 0 or EXIT_ABORT not in done.stderr or "]: Traceback" in done.stderr:
            break
    return done


@pytest.mark.timeout(ATTEMPTS * BLOCK_TIMEOUT + 30)
@pytest.mark.parametrize(("where", "code"), BLOCKS, ids=[where for where, _ in BLOCKS])
def test_readme_python_block_runs(where, code, tmp_path):
    done = run_block(code, tmp_path)
    head = "\n".join(code.splitlines()[:6])
    assert done.returncode == 0, (
        f"{where}: the ```python block exits with {done.returncode}; its first lines:\n{head}\n"
        f"stderr (last 4000 characters):\n{done.stderr[-4000:]}\nstdout:\n{done.stdout[-1000:]}"
    )


@pytest.mark.timeout(120)
def test_a_block_that_raises_fails(tmp_path):
    """The check above sees a failing block, in both launch modes."""
    assert run_block("raise SystemExit('broken block')\n", tmp_path).returncode != 0
    script = "# torchrun --nproc-per-node 2 x.py\nraise RuntimeError('broken script')\n"
    done = run_block(script, tmp_path)
    assert done.returncode != 0 and "broken script" in done.stderr


def test_make_quickstart_runs_the_readmes_quick_start_as_written():
    # `make quickstart` runs examples/quickstart.py: README's first block, as written there (its docstring
    # aside), so the block the test above runs is the one the target runs.
    script = (ROOT / "examples" / "quickstart.py").read_text(encoding="utf-8")
    docstring_end = script.index('"""', 3) + 3
    body = script[docstring_end:].lstrip("\n")
    readme = README.read_text(encoding="utf-8")
    first = readme[readme.index("## Quick start: a transformers model") :]
    ((_, block), *_) = python_blocks(first)
    assert body == block
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    target = makefile[makefile.index("\nquickstart:") :].split("\n\n")[0]
    assert "examples/quickstart.py" in target, target
