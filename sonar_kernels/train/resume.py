"""sonar-train's run folder as the record of a run that may be interrupted: Ctrl-C (SIGINT) and ``--resume``.

Every finished (seed, arm) run is written to ``<run folder>/resume/seed<S>-<arm>.json`` as it finishes
(its ``run_arm`` result, counted updates, checksums; the floats as JSON writes them, which read back bit
for bit), the memory pass to ``memory.json`` and the timing pass to ``timing.json``, and the run's options to
``options.json`` when it starts. On Ctrl-C the run writes a partial report.json (:func:`results.partial`),
prints one line and exits with code 130; ``sonar-train --resume DIR`` refuses other options (naming them),
loads what finished, runs only what is missing and writes the report an uninterrupted run writes.

A bitwise pair (a sonar arm and its control, ``arms.CONTROLS``, compared on the first seed) is kept only
when both finished: the first's parameters live in memory until the second has trained, and they are not
written to disk (a real preset's are gigabytes), so an interruption between the two re-runs the first."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from sonar_kernels.train.arms import CONTROLS
from sonar_kernels.train.data import UsageError
from sonar_kernels.train.options import build_parser
from sonar_kernels.train.results import partial
from sonar_kernels_cli.options import INTERRUPTED, RESUME_FOLDER, RESUME_FREE

# Options that do not change what a run computes: free to differ between a run and its resumption.
FREE = (*RESUME_FREE, "run_name", "argv")


def options_of(args) -> dict:
    """The options that decide what the run computes, as JSON reads them back (resolved: the device, the
    dtype and torch's AdamW flags as the run chose them)."""
    chosen = {k: v for k, v in vars(args).items() if k not in FREE and _plain(v)}
    chosen["device"] = str(args.device_obj)
    return json.loads(json.dumps(chosen))


def _plain(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, list, tuple))


class RunState:
    """What a run has finished, on disk in ``folder/resume/`` (leader process only) and in memory.

    Attributes:
        folder: the run folder (``--out/NAME``).
        records: {(seed, arm): the finished run's record}.
        memory: the memory pass's result per arm, or None until it ran.
        timing: the timing pass's (step times per arm or None, note), or None until it ran.
        report: the run's report header once it is known (the partial report starts from it).
        order: every (seed, arm) the run trains, in order.
        pairs: the bitwise pairs among the arms (sonar arm -> control, :func:`pairs_of`).
        resumed: the number of runs loaded from the interrupted run.
    """

    def __init__(self, folder: Path | None, order: list[tuple[int, str]], pairs: dict[str, str]):
        self.folder, self.order, self.pairs = folder, order, pairs
        self.records, self.memory, self.timing, self.report = {}, None, None, None
        self.resumed = 0

    @property
    def files(self) -> Path:
        return self.folder / RESUME_FOLDER

    def start(self, argv: list[str], options: dict, commit: str) -> None:
        """A new run: its command line (read back by ``--resume``), resolved options and the git commit of
        the code that runs it."""
        self.files.mkdir()
        _write(self.files / "options.json", {"argv": argv, "options": options, "commit": commit})

    def load(self, options: dict, commit: str) -> None:
        """Resuming: refuses (UsageError) another code than the interrupted run's (``commit``, the git commit
        that runs now, against the one it recorded: the finished runs would be mixed with runs of other code;
        a run folder written before commits were recorded, or code outside git on both sides, is not
        checked) and options that differ from its own, naming each; then loads its finished runs and passes;
        a bitwise pair (``pairs``: sonar arm -> control) of which only the first finished is dropped, to be
        trained again with its control."""
        written = json.loads((self.files / "options.json").read_text())
        stored, recorded = written["options"], written.get("commit")
        if recorded is not None and recorded != commit:
            raise UsageError(
                f"--resume {self.folder}: the interrupted run ran commit {recorded[:12]}, this is {commit[:12]}: "
                "its finished runs would be mixed with runs of other code; check out its commit to resume, "
                "or start a new run"
            )
        flags = {a.dest: a.option_strings[0] for a in build_parser()._actions if a.option_strings}
        differ = [
            f"{flags.get(key, '--' + key.replace('_', '-'))} {options.get(key)!r} here, {stored.get(key)!r} there"
            for key in sorted(set(stored) | set(options))
            if stored.get(key) != options.get(key)
        ]
        if differ:
            raise UsageError(
                f"--resume {self.folder}: the options differ from the interrupted run's ({'; '.join(differ)}); "
                "resume with its options (sonar-train --resume DIR alone reads them)"
            )
        for seed, name in self.order:
            path = self.files / f"seed{seed}-{name}.json"
            if path.exists():
                self.records[seed, name] = json.loads(path.read_text())
        first_seed = self.order[0][0]
        for arm, control in self.pairs.items():
            done = [name for name in (arm, control) if (first_seed, name) in self.records]
            if len(done) == 1:  # its partner's parameters were not kept: trained again
                del self.records[first_seed, done[0]]
        for kind in ("memory", "timing"):
            path = self.files / f"{kind}.json"
            if path.exists():
                value = json.loads(path.read_text())
                setattr(self, kind, value if kind == "memory" else tuple(value))
        self.resumed = len(self.records)

    def record(self, seed: int, name: str, record: dict) -> None:
        """A finished run's record, kept (on disk when the run has a folder: not on the other ranks)."""
        self.records[seed, name] = record
        if self.folder is not None:
            _write(self.files / f"seed{seed}-{name}.json", record)

    def record_pass(self, kind: str, value) -> None:
        """The memory pass's result (``kind`` "memory") or the timing pass's ("timing")."""
        setattr(self, kind, value)
        if self.folder is not None:
            _write(self.files / f"{kind}.json", value)

    def describe(self) -> str:
        """What finished, e.g. "3 of 7 runs (seed 0: standard, sonar; seed 1: standard) and the memory pass"."""
        seeds = {}
        for seed, name in self.order:
            if (seed, name) in self.records:
                seeds.setdefault(seed, []).append(name)
        runs = "; ".join(f"seed {seed}: {', '.join(names)}" for seed, names in seeds.items())
        passes = [kind + " pass" for kind in ("memory", "timing") if getattr(self, kind) is not None]
        first = self.order[0][0]
        again = [
            f"{arm if (first, arm) in self.records else control} on seed {first} trains again with "
            f"{control if (first, arm) in self.records else arm}"
            for arm, control in self.pairs.items()
            if ((first, arm) in self.records) != ((first, control) in self.records)
        ]
        return (
            f"{len(self.records)} of {len(self.order)} runs" + (f" ({runs})" if runs else "")
            + (f" and the {' and the '.join(passes)}" if passes else "")
            + (f" ({'; '.join(again)}: a bitwise pair is kept whole)" if again else "")
        )  # fmt: skip


def pairs_of(arms: list[str]) -> dict[str, str]:
    """The bitwise pairs among ``arms``: sonar arm -> its control, both running."""
    return {arm: control for arm, control in CONTROLS.items() if arm in arms and control in arms}


def interrupted(state: RunState | None) -> int:
    """Ctrl-C: writes the partial report.json of what finished (when the run has a folder) and prints one line
    on stderr, saying what finished and how to resume; returns the exit code, 130."""
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut the report short
    try:
        return _interrupted(state)
    finally:
        signal.signal(signal.SIGINT, handler)


def _interrupted(state: RunState | None) -> int:
    if state is not None and state.report is not None and state.folder is None:
        return INTERRUPTED  # another rank of a torchrun run: rank 0 reports
    if state is None or state.report is None:
        where = (
            ""
            if state is None or state.folder is None
            else f"; resume with: sonar-train --resume {state.folder}"
        )
        print(f"sonar-train: interrupted before training started{where}", file=sys.stderr)
        return INTERRUPTED
    report = partial(state.report, state.records, state.order, state.memory, state.folder)
    _write(state.folder / "report.json", report)
    print(
        f"sonar-train: interrupted; finished {state.describe()}, kept in {state.files}; wrote the partial "
        f"{state.folder / 'report.json'}; resume with: sonar-train --resume {state.folder}",
        file=sys.stderr,
    )
    return INTERRUPTED


def _write(path: Path, value) -> None:
    """JSON, written whole or not at all (Ctrl-C in the middle leaves the previous file)."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(temporary, path)
