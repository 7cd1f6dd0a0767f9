"""pytest set-up of the layer benchmark (bench/test_layer.py): the Triton interpreter on CPU-only
machines, and a side-by-side table of the providers at the end of the run."""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before sonar_kernels is imported

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_benchmark_update_json(config, benchmarks, output_json):
    import triton

    output_json["versions"] = {"torch": torch.__version__, "triton": triton.__version__}
    output_json["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.benchmarks:
        return
    from table import side_by_side

    rows = [
        {**bench.extra_info, "median_s": bench.stats.median, "rounds": bench.stats.rounds}
        for bench in session.benchmarks
        if bench.stats is not None
    ]
    terminalreporter.write_sep("=", "providers side by side")
    terminalreporter.write_line(side_by_side(rows))
