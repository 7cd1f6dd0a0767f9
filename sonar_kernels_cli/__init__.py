"""sonar-train's launcher: the command line is parsed here, without torch, so that ``--help`` and argument
errors answer at once; only a parse that succeeded imports sonar_kernels (and with it torch) to run
(``sonar_kernels.train.cli``). A package of its own because importing anything under sonar_kernels runs
sonar_kernels/__init__.py, which imports torch."""

from __future__ import annotations

import sys

from sonar_kernels_cli.options import INTERRUPTED, parse


def main(argv: list[str] | None = None) -> int:
    """The ``sonar-train`` command: parse (exit code 2 on a bad option, 0 after ``--help``), then import the
    trainer and run (``sonar_kernels.train.cli.run``)."""
    parser, args = parse(argv)
    try:
        from sonar_kernels.train.cli import run
    except KeyboardInterrupt:  # Ctrl-C while torch loads: nothing started
        print("sonar-train: interrupted before training started; nothing was written", file=sys.stderr)
        return INTERRUPTED
    return run(parser, args)
