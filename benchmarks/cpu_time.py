"""CPU seconds that processes have run, read from /proc (Linux), for benchmarks that ask whether a
wall time is bound by the machine's cores: the work of every process taking part, divided by the cores,
is the least wall time that work can take there.

Imported by the benchmark scripts in this folder (run as `python benchmarks/NAME.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


def cpu_seconds(pids: Iterable[int]) -> float:
    """Seconds on a CPU so far, summed over every thread of each process in ``pids`` (the scheduler's
    nanosecond count per thread, /proc/PID/task/TID/schedstat; a thread that has exited no longer
    counts, so take the difference of two readings over a span in which the threads stay).
    RuntimeError where the kernel does not keep that count."""
    total = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except FileNotFoundError:  # the thread ended between the listing and the read
                continue
            except (OSError, ValueError, IndexError) as exc:
                raise RuntimeError(f"no per-thread CPU time in /proc ({exc}): needs Linux with schedstats") from None
    return total / 1e9
