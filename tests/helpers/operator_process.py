"""`python -m rljob.operator` as a real process for integration tests (liveness and metrics on loopback)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.helpers.processes import free_port
from tests.helpers.processes import stop as stop_processes

REPO = Path(__file__).resolve().parents[2]


class OperatorProcess:
    """The operator started with `args(liveness_port, metrics_port)` and `env`, output to `log_path`."""

    def __init__(
        self, args: Callable[[int, int], list[str]], log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.log_path = log_path
        self.liveness_port, self.metrics_port = free_port(), free_port()
        self.args = args(self.liveness_port, self.metrics_port)
        self.env = dict(env if env is not None else os.environ)
        # The kubernetes client writes the kubeconfig's certificates to temporary files that it removes
        # only when the process exits cleanly: each killed operator left three in /tmp. Here they go
        # beside the log, in the test's own folder.
        tmp = log_path.parent / f"{log_path.stem}-tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        self.env["TMPDIR"] = str(tmp)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait: bool = True) -> None:
        """Start the process; with `wait`, until its liveness endpoint answers."""
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rljob.operator", *self.args],
                stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO, start_new_session=True,
            )
        if wait:
            deadline = time.monotonic() + 60
            while not self._alive():
                if time.monotonic() > deadline:
                    raise AssertionError(f"operator liveness endpoint not ready after 60 s:\n{self.log_tail()}")
                time.sleep(0.5)

    def _alive(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, f"operator exited:\n{self.log_tail()}"
        try:
            return httpx.get(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        """SIGKILL: no cleanup, as a crashed or evicted operator."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit."""
        if self.proc is not None:
            stop_processes([self.proc])

    def metrics(self) -> str:
        """The operator's Prometheus exposition text."""
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_size(self) -> int:
        """Bytes logged so far: a mark to wait for lines logged after it (the log survives restarts)."""
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def wait_log(self, pattern: str, since: int, timeout: float = 300.0, interval: float = 0.02) -> str:
        """The first log line after byte `since` matching the regex `pattern`, as soon as it is written.

        Polls the file from `since` on (a short interval: a fault test kills on this line, mid-operation).
        """
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        pos = since
        while True:
            with self.log_path.open("rb") as log:
                log.seek(pos)
                chunk = log.read()
            # Only whole lines: a line being written is read again, complete, on the next poll.
            whole = chunk[: chunk.rfind(b"\n") + 1]
            pos += len(whole)
            for line in whole.decode(errors="replace").splitlines():
                if regex.search(line):
                    return line
            if time.monotonic() > deadline:
                raise AssertionError(f"no operator log line matching {pattern!r} after {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(interval)

    def log_tail(self, lines: int = 80) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])
