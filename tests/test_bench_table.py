"""The layer benchmark's table (bench/table.py): one ratio convention (provider / standard, below 1 is
better), the spread beside every median, and the busy-machine verdict."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import table


def _row(provider, median_ms, p10_ms=None, p90_ms=None, peak_mib=100.0, phase="step"):
    return {
        "provider": provider, "phase": phase, "shape": "cpu-tiny", "routing": "uniform", "device": "cpu",
        "backend": "torch", "threads": 2, "flops": 10**9, "median_s": median_ms / 1000,
        "p10_s": (p10_ms or median_ms) / 1000, "p90_s": (p90_ms or median_ms) / 1000, "rounds": 20,
        "peak_bytes": int(peak_mib * 2**20),
    }  # fmt: skip


def test_ratio_is_provider_over_standard_so_below_one_is_better():
    # sonar at 26 ms, standard at 100 ms: sonar is faster, and the ratio says 0.26 (not 3.85).
    assert table.ratio(26.0, 100.0) == pytest.approx(0.26)
    assert table.ratio(391.0, 100.0) == pytest.approx(3.91)
    assert table.ratio(1.0, None) != table.ratio(1.0, None)  # NaN without a standard


def test_the_table_prints_one_convention_and_the_spread_beside_every_median():
    rows = [_row("sonar-fused", 26.0, 25.0, 27.0, peak_mib=80.0), _row("standard", 100.0, 98.0, 103.0)]
    text = table.side_by_side(rows)
    assert table.CONVENTION in text
    fused = next(line for line in text.splitlines() if line.strip().startswith("sonar-fused "))
    assert fused.split()[1:4] == ["26.00", "25.00-27.00", "0.26"]  # median, p10-p90, time / standard
    assert fused.split()[6] == "0.80"  # peak memory / standard
    assert "sonar-fused / standard: step time 0.26, peak memory 0.80" in text
    # No second convention: no speedup (standard / provider) anywhere.
    assert "3.85" not in text and "speedup" not in text
    assert text.splitlines()[-1].startswith("quiet machine")


def test_a_row_with_a_wide_spread_marks_the_run_busy():
    assert not table.is_busy(_row("standard", 100.0, 95.0, 95.0 * table.BUSY_SPREAD))
    assert table.is_busy(_row("standard", 100.0, 95.0, 95.0 * table.BUSY_SPREAD * 1.01))
    rows = [_row("sonar-fused", 26.0, 20.0, 40.0), _row("standard", 100.0, 98.0, 103.0)]
    text = table.side_by_side(rows)
    fused = next(line for line in text.splitlines() if line.strip().startswith("sonar-fused "))
    assert fused.endswith(" !")
    assert "(busy: not comparable)" in text
    last = text.splitlines()[-1]
    assert last.startswith("BUSY MACHINE") and "1 of 2 rows" in last and "not comparable" in last


def test_other_processes_using_the_cpu_mark_the_run_busy():
    rows = [_row("sonar-fused", 26.0, 25.0, 27.0), _row("standard", 100.0, 98.0, 103.0)]
    assert table.busy_line(rows, others=0.05, cores=2).startswith("quiet machine")
    line = table.busy_line(rows, others=0.40, cores=2)
    assert line.startswith("BUSY MACHINE") and "40 % of the 2 cores" in line
    # 3 s of the machine's busy CPU time over 2 s on 2 cores, 1 s of it this process's: 50 % by others.
    assert table.others_share((10.0, 1.0), (13.0, 2.0), wall_s=2.0, cores=2) == pytest.approx(0.5)
    assert table.others_share(None, (13.0, 2.0), wall_s=2.0, cores=2) is None
