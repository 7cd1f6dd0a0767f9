"""The layer benchmark's table (bench/table.py): one ratio convention (provider / standard-fused, below 1 is
better), the spread beside every median, sonar's goals under each training step, the busy-machine verdict,
and the device, versions and commit every row records."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import table

MiB = 2**20


def _row(provider, median_ms, p10_ms=None, p90_ms=None, peak_mib=100.0, phase="step"):
    return {
        "provider": provider, "phase": phase, "shape": "cpu-tiny", "T": 16, "H": 32, "I": 16, "E": 4,
        "top_k": 2, "routing": "uniform", "device": "cpu", "device_name": "a CPU", "backend": "torch",
        "threads": 2, "flops": 10**9, "median_s": median_ms / 1000, "p10_s": (p10_ms or median_ms) / 1000,
        "p90_s": (p90_ms or median_ms) / 1000, "rounds": 20, "peak_bytes": int(peak_mib * MiB),
        "expert_grad_bytes": 25 * MiB, "commit": "abc1234", "dirty": False,
        "versions": {"torch": "2.13.0", "triton": "3.6.0", "transformers": "5.24.0"},
    }  # fmt: skip


def _line(text: str, provider: str) -> list[str]:
    return next(line for line in text.splitlines() if line.strip().startswith(provider + " ")).split()


def test_ratio_is_provider_over_the_baseline_so_below_one_is_better():
    # sonar at 26 ms, standard-fused at 100 ms: sonar is faster, and the ratio says 0.26 (not 3.85).
    assert table.ratio(26.0, 100.0) == pytest.approx(0.26)
    assert table.ratio(391.0, 100.0) == pytest.approx(3.91)
    assert table.ratio(1.0, None) != table.ratio(1.0, None)  # NaN without a baseline
    # standard-fused's peak 100 MiB, sonar's 80, the layer's expert gradients 25 MiB: 0.8 of them saved.
    assert table.saved_share(100 * MiB, 80 * MiB, 25 * MiB) == pytest.approx(0.8)
    assert table.saved_share(100 * MiB, 110 * MiB, 25 * MiB) == pytest.approx(-0.4)  # sonar's peak higher
    assert table.saved_share(1, 1, 0) != table.saved_share(1, 1, 0)


def test_the_table_divides_by_standard_fused_and_reads_sonars_goals():
    rows = [
        _row("sonar", 26.0, 25.0, 27.0, peak_mib=80.0),
        _row("standard-fused", 100.0, 98.0, 103.0, peak_mib=100.0),
        _row("standard", 110.0, 108.0, 112.0, peak_mib=120.0),
    ]
    text = table.side_by_side(rows)
    assert table.CONVENTION in text and "provider / standard-fused" in text
    # median, p10-p90, time / standard-fused; then TFLOP/s, peak MiB, peak / standard-fused.
    assert _line(text, "sonar")[1:4] == ["26.00", "25.00-27.00", "0.26"] and _line(text, "sonar")[6] == "0.80"
    assert _line(text, "standard")[3] == "1.10" and _line(text, "standard")[6] == "1.20"
    assert _line(text, "standard-fused")[3] == "1.00" and _line(text, "standard-fused")[6] == "1.00"
    assert "sonar / standard-fused: step time 0.26\n" in text + "\n"
    # (100 - 80) MiB saved of the layer's 25 MiB of expert gradients.
    assert "sonar's peak saves 0.80 of the layer's expert-gradient bytes" in text
    assert "= 20.000 MiB of 25.000 MiB" in text
    assert "cpu-tiny (T 16, H 32, I 16, E 4, top_k 2), uniform routing, training step" in text
    # No second convention: no speedup (baseline / provider) anywhere.
    assert "3.85" not in text and "speedup" not in text
    assert text.splitlines()[-1].startswith("quiet machine")


def test_sonars_goals_are_read_per_shape_and_only_for_the_step():
    rows = [
        _row("sonar", 26.0, peak_mib=80.0),
        _row("standard-fused", 100.0),
        _row("sonar-unfused", 50.0, phase="forward"),
        _row("standard-fused", 40.0, phase="forward"),
    ]
    larger = [
        dict(r, shape="cpu-large", median_s=2 * r["median_s"], peak_bytes=2 * r["peak_bytes"]) for r in rows
    ]
    text = table.side_by_side(rows + larger)
    assert text.count("sonar / standard-fused: step time") == 2  # one per shape, none for the forward
    assert text.count("sonar's peak saves 0.80") == 1 and text.count("sonar's peak saves 1.60") == 1
    assert _line(text, "sonar-unfused")[3] == "1.25"  # the forward's ratio to standard-fused's forward


def test_a_row_with_a_wide_spread_marks_the_run_busy():
    assert not table.is_busy(_row("standard-fused", 100.0, 95.0, 95.0 * table.BUSY_SPREAD))
    assert table.is_busy(_row("standard-fused", 100.0, 95.0, 95.0 * table.BUSY_SPREAD * 1.01))
    rows = [_row("sonar", 26.0, 20.0, 40.0), _row("standard-fused", 100.0, 98.0, 103.0)]
    text = table.side_by_side(rows)
    assert " ".join(_line(text, "sonar")).endswith(" !")
    time_line = next(line for line in text.splitlines() if "step time" in line)
    assert time_line.endswith("(busy: not comparable)")
    # The peaks are counted allocations: a busy machine does not change them.
    assert "busy" not in next(line for line in text.splitlines() if "peak saves" in line)
    last = text.splitlines()[-1]
    assert last.startswith("BUSY MACHINE") and "1 of 2 rows" in last and "not comparable" in last


def test_other_processes_using_the_cpu_mark_the_run_busy():
    rows = [_row("sonar", 26.0, 25.0, 27.0), _row("standard-fused", 100.0, 98.0, 103.0)]
    assert table.busy_line(rows, others=0.05, cores=2).startswith("quiet machine")
    line = table.busy_line(rows, others=0.40, cores=2)
    assert line.startswith("BUSY MACHINE") and "40 % of the 2 cores" in line
    # 3 s of the machine's busy CPU time over 2 s on 2 cores, 1 s of it this process's: 50 % by others.
    assert table.others_share((10.0, 1.0), (13.0, 2.0), wall_s=2.0, cores=2) == pytest.approx(0.5)
    assert table.others_share(None, (13.0, 2.0), wall_s=2.0, cores=2) is None


def _git(repo: Path, *args: str) -> str:
    command = ["git", "-C", str(repo), "-c", "user.name=bench", "-c", "user.email=bench@example.com", *args]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


def test_the_commit_is_recorded_with_whether_the_tree_was_dirty(tmp_path):
    assert table.git_commit(tmp_path) == (None, None)  # not a repository
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "commit", "-q", "-m", "first")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD")
    assert table.git_commit(tmp_path) == (head, False)
    (tmp_path / "b.py").write_text("y = 2\n")  # untracked: not what was measured
    assert table.git_commit(tmp_path) == (head, False)
    (tmp_path / "a.py").write_text("x = 2\n")  # a tracked file changed: the run measured uncommitted code
    assert table.git_commit(tmp_path) == (head, True)
    info = table.run_info(tmp_path)
    assert info["commit"] == head and info["dirty"] is True and info["device"] in ("cpu", "cuda")
    assert set(info["versions"]) == {"torch", "triton", "transformers"} and info["device_name"]
    # The table's first line: the device, the versions and the commit of the rows.
    rows = [dict(_row("sonar", 26.0), **info), dict(_row("standard-fused", 100.0), **info)]
    first = table.side_by_side(rows).splitlines()[0]
    assert f"commit {head} (uncommitted changes)" in first and f"torch {info['versions']['torch']}" in first
