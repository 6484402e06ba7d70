"""A process's peak extra resident memory over a block of code, read from /proc (Linux).

glibc keeps freed memory mapped (its heap grows, and the mmap threshold rises with each large free),
so by default RSS tracks the high-water mark of the allocator rather than the live bytes.
``exact_malloc`` fixes the mmap threshold low: every allocation above it is its own mapping, given
back to the kernel when freed, and RSS then follows the live tensors. ``PeakRss`` samples RSS in a
thread; a buffer held for less than a few sampling periods may be missed, a whole model held while
it is consumed cannot be.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from types import TracebackType

_PAGE = os.sysconf("SC_PAGE_SIZE")
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3


def rss_bytes() -> int:
    """This process's resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def exact_malloc(threshold: int = 64 << 10) -> None:
    """Make glibc map every allocation above ``threshold`` on its own and unmap it when freed (see
    the module docstring); RuntimeError where glibc's mallopt is not there or refuses."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError as exc:
        raise RuntimeError(f"glibc not found ({exc}): RSS would not track live memory") from None
    if not (libc.mallopt(_M_MMAP_THRESHOLD, threshold) and libc.mallopt(_M_TRIM_THRESHOLD, threshold)):
        raise RuntimeError("mallopt refused the mmap/trim thresholds")


def heap_malloc() -> None:
    """Undo ``exact_malloc`` for timing: glibc serves allocations of up to 32 MB (its largest mmap
    threshold) from its heap and keeps freed memory there, so a buffer allocated anew for each of many
    like-sized pieces reuses the same pages instead of faulting fresh ones in (what glibc's dynamic
    threshold settles to by itself, and what a GPU's caching allocator does). RSS then tracks the
    allocator's high-water mark, not the live bytes."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError as exc:
        raise RuntimeError(f"glibc not found ({exc})") from None
    if not (libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)):
        raise RuntimeError("mallopt refused the mmap/trim thresholds")


class PeakRss:
    """``with PeakRss() as peak: ...``; then ``peak.extra``: the highest RSS seen inside the block
    above the RSS at its start, in bytes."""

    def __init__(self, period_s: float = 0.0005) -> None:
        self.period_s = period_s
        self.baseline = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)

    @property
    def extra(self) -> int:
        """Peak RSS inside the block minus RSS at its start."""
        return max(0, self.peak - self.baseline)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.period_s)

    def __enter__(self) -> PeakRss:
        self.baseline = self.peak = rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
