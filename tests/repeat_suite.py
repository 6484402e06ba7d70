"""Run a pytest selection N times, optionally beside a CPU-heavy load, and tabulate each test's record.

A test that passes or fails with the machine's speed shows up here: run the selection a few times
idle and a few times with `--stress` (a busy loop on every core, pure Python processes stopped at the
end), then read the table (passes, failures, duration min/median/max per test).

    .venv/bin/python tests/repeat_suite.py --runs 3 --stress --label loaded -- tests/integration -m "not realnode"

Everything after `--` goes to pytest. Each run writes its junit XML and output under `--out`
(default `runs/repeat/<UTC time>-<label>/`); `summary.json` and `summary.md` hold the table. The
markdown is what docs/development.md records ("Repeat runs").
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from multiprocessing.synchronize import Event
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class CaseResult:
    """One test's outcome in one run, as junit XML reports it."""

    test: str  # classname::name
    outcome: str  # passed, failed, skipped
    seconds: float


@dataclass(frozen=True)
class RunRecord:
    """One pytest run: its exit status, wall time and the tests it reported."""

    index: int
    returncode: int
    wall_s: float
    cases: list[CaseResult]


@dataclass
class Row:
    """One test over all runs."""

    test: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    durations: list[float] = field(default_factory=list)

    @property
    def spread(self) -> tuple[float, float, float]:
        """(min, median, max) seconds over the runs that did not skip it; zeros if none."""
        if not self.durations:
            return (0.0, 0.0, 0.0)
        return (min(self.durations), statistics.median(self.durations), max(self.durations))


def parse_junit(path: Path) -> list[CaseResult]:
    """The test cases of a junit XML file (pytest's `--junitxml`); a missing file (pytest died) gives none."""
    if not path.exists():
        return []
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        cases.append(CaseResult(test, outcome, float(case.get("time") or 0.0)))
    return cases


def summarize(runs: Sequence[RunRecord]) -> list[Row]:
    """Per-test counts and durations over the runs; failing tests first, then the slowest (median)."""
    rows: dict[str, Row] = {}
    for run in runs:
        for case in run.cases:
            row = rows.setdefault(case.test, Row(case.test))
            setattr(row, case.outcome, getattr(row, case.outcome) + 1)
            if case.outcome != "skipped":
                row.durations.append(case.seconds)
    return sorted(rows.values(), key=lambda r: (-r.failed, -r.spread[1], r.test))


def to_markdown(rows: Sequence[Row], runs: Sequence[RunRecord], title: str) -> str:
    """The table as markdown, under a line per run (exit status, wall time)."""
    lines = [f"### {title}", ""]
    lines += [f"- run {r.index}: exit {r.returncode}, {r.wall_s / 60:.1f} min, "
              f"{sum(c.outcome == 'failed' for c in r.cases)} failed of {len(r.cases)}" for r in runs]
    lines += ["", "| test | passed | failed | skipped | min s | median s | max s |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        low, mid, high = row.spread
        lines.append(f"| `{row.test}` | {row.passed} | {row.failed} | {row.skipped} | {low:.1f} | {mid:.1f} | {high:.1f} |")
    return "\n".join(lines) + "\n"


def _spin(stop: Event) -> None:
    # Pure Python work, checking the stop flag only now and then so the loop stays CPU-bound.
    count = 0
    while not stop.is_set():
        for _ in range(100_000):
            count += 1


@contextmanager
def cpu_stress(processes: int) -> Iterator[list[multiprocessing.process.BaseProcess]]:
    """A busy loop in `processes` processes (0: none) for the duration of the block (yields them), then stopped."""
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    workers = [ctx.Process(target=_spin, args=(stop,), daemon=True, name=f"stress-{i}") for i in range(processes)]
    for worker in workers:
        worker.start()
    try:
        yield workers
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.terminate()
                worker.join()


def run_once(index: int, pytest_args: Sequence[str], out: Path, timeout_s: float) -> RunRecord:
    """One pytest run of the selection, its output and junit XML under `out`."""
    xml, log = out / f"run-{index}.xml", out / f"run-{index}.log"
    cmd = [sys.executable, "-m", "pytest", *pytest_args, f"--junitxml={xml}", "-p", "no:cacheprovider"]
    start = time.monotonic()
    with log.open("wb") as sink:
        try:
            code = subprocess.run(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = 124
    return RunRecord(index, code, time.monotonic() - start, parse_junit(xml))


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, run, write summary.json and summary.md, print the table; exit 1 if any run failed."""
    parser = argparse.ArgumentParser(
        prog="tests/repeat_suite.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="how many times to run the selection (default 3)")
    parser.add_argument("--stress", action="store_true", help="run a busy loop on every core beside the runs")
    parser.add_argument("--stress-processes", type=int, default=os.cpu_count() or 1,
                        help="busy processes with --stress (default: one per core)")
    parser.add_argument("--label", default="", help="a name for this series (in the directory and the title)")
    parser.add_argument("--out", type=Path, help="output directory (default runs/repeat/<UTC time>-<label>)")
    parser.add_argument("--timeout-min", type=float, default=90.0, help="kill a run after this many minutes")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: the pytest selection and flags")
    args = parser.parse_args(argv)
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    if args.runs < 1:
        parser.error("--runs: at least 1")
    if not pytest_args:
        parser.error("give the pytest selection after --, e.g. -- tests/unit/operator/test_sync_queue.py")
    label = args.label or ("stress" if args.stress else "idle")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out: Path = args.out or REPO / "runs" / "repeat" / f"{stamp}-{label}"
    out.mkdir(parents=True, exist_ok=True)

    runs = []
    with cpu_stress(args.stress_processes if args.stress else 0):
        for index in range(1, args.runs + 1):
            run = run_once(index, pytest_args, out, args.timeout_min * 60)
            print(f"run {index}/{args.runs}: exit {run.returncode} in {run.wall_s:.0f} s", flush=True)
            runs.append(run)
    rows = summarize(runs)
    stress = f"{args.stress_processes} busy processes beside it" if args.stress else "idle"
    title = f"{label}: {args.runs} runs of `pytest {' '.join(pytest_args)}`, {stress} ({stamp})"
    markdown = to_markdown(rows, runs, title)
    (out / "summary.md").write_text(markdown)
    summary = {"title": title, "pytest_args": pytest_args, "stress": args.stress,
               "runs": [{"index": r.index, "returncode": r.returncode, "wall_s": r.wall_s} for r in runs],
               "tests": [{**asdict(r), "spread_s": r.spread} for r in rows]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(markdown)
    print(f"written: {out / 'summary.md'}, {out / 'summary.json'}")
    return 0 if all(r.returncode == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
