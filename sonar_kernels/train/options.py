"""sonar-train's options: the command line and its torch-free checks (``sonar_kernels_cli.options``, which
``sonar-train`` parses before torch is imported), then the checks that need torch: the device and, for
``--backend triton`` on the CPU, the Triton interpreter. Errors name the option before anything runs."""

from __future__ import annotations

import argparse

import torch

from sonar_kernels_cli.options import HELDOUT_BATCHES, build_parser, parse

__all__ = ["HELDOUT_BATCHES", "build_parser", "check_device", "parse_args"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """``sonar-train``'s options, every check made (:func:`check_device` included); exits with code 2 on a
    bad one."""
    parser, args = parse(argv)
    return check_device(parser, args)


def check_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Resolves ``--device`` (default: cuda when available) into ``args.device_obj``; ``parser.error`` (exit
    code 2) when it is not here, or when ``--backend triton`` on the CPU has no interpreter to run on."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        args.device_obj = torch.device(device)
    except RuntimeError:
        parser.error(f"--device {device!r} is not a device (cpu, cuda, cuda:N)")
    if args.device_obj.type not in ("cpu", "cuda"):
        parser.error(f"--device {device!r}: only cpu and cuda are supported")
    if args.device_obj.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device!r}: no CUDA device here")
    if args.backend == "triton" and args.device_obj.type == "cpu":
        from sonar_kernels import ops

        if not ops.triton_interpreting():
            parser.error(
                "--backend triton on the CPU needs TRITON_INTERPRET=1 (the interpreter: tests, not training)"
            )
    return args
