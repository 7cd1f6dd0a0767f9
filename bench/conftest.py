"""pytest set-up of the layer benchmark (bench/test_layer.py): the Triton interpreter on CPU-only
machines, how busy the machine was during the run, the JSON's additions (per row p10, p90 and busy beside
the extra_info bench/test_layer.py records; for the run the device, versions, commit and machine load) and
a side-by-side table of the providers at the end (bench/table.py; pytest-benchmark's own table, whose
ratios are to the fastest row, is not printed)."""

import os
import sys
import time
from pathlib import Path

import numpy
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before sonar_kernels is imported

sys.path.insert(0, str(Path(__file__).resolve().parent))

import table

_RUN = {}


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    session = getattr(config, "_benchmarksession", None)
    if session is not None:
        session.quiet = True  # one table, one ratio convention: bench/table.py's


def pytest_sessionstart(session):
    _RUN.update(start=time.perf_counter(), cpu=table.cpu_seconds())


def _machine() -> tuple[float | None, int]:
    """(other processes' share of the CPU since the session started, the CPU count)."""
    cores = os.cpu_count() or 1
    if "start" not in _RUN:
        return None, cores
    wall = time.perf_counter() - _RUN["start"]
    return table.others_share(_RUN["cpu"], table.cpu_seconds(), wall, cores), cores


def _rows(benchmarks) -> list[dict]:
    rows = []
    for bench in benchmarks:
        if bench.stats is None:
            continue
        data = bench.stats.data
        rows.append(
            {
                **bench.extra_info,
                "name": bench.name,
                "median_s": bench.stats.median,
                "p10_s": float(numpy.percentile(data, 10)),
                "p90_s": float(numpy.percentile(data, 90)),
                "rounds": len(data),
            }
        )
    return rows


def pytest_benchmark_update_json(config, benchmarks, output_json):
    # The run's device, versions and commit (each row's extra_info holds the same, table.run_info).
    output_json.update(table.run_info(Path(__file__).resolve().parents[1]))
    rows = {r["name"]: r for r in _rows(config._benchmarksession.benchmarks)}
    for entry in output_json["benchmarks"]:
        row = rows.get(entry["name"])
        if row is not None:
            entry["stats"].update(p10=row["p10_s"], p90=row["p90_s"], busy=table.is_busy(row))
    others, cores = _machine()
    output_json["machine_load"] = {"other_processes_cpu_share": others, "cores": cores}


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.benchmarks:
        return
    rows = _rows(session.benchmarks)
    if not rows:
        return
    others, cores = _machine()
    terminalreporter.write_sep("=", "providers side by side")
    terminalreporter.write_line(table.side_by_side(rows, others, cores))
    if session.json:
        terminalreporter.write_line(
            f"JSON (pytest-benchmark's; per row the extra_info fields, p10, p90 and busy): {session.json}"
        )
