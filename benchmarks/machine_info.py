"""What a benchmark records about the machine it ran on: numbers mean nothing without it.

Imported by the benchmark scripts in this folder (run as `python benchmarks/NAME.py`, so this folder
is on sys.path).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, or 'unknown CPU'."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def describe(extra: str = "") -> str:
    """CPU model, cores, OS, Python, plus `extra` (library versions, threads, GPU)."""
    text = (f"{cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}, "
            f"Python {platform.python_version()}")
    return f"{text}, {extra}" if extra else text


def load_average() -> float:
    """1-minute load average: on a shared machine, wall seconds mean little without it."""
    try:
        return round(os.getloadavg()[0], 1)
    except OSError:
        return float("nan")
