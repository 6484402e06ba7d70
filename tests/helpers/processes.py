"""Start real server processes on loopback for integration tests, and stop them cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from rljob.api.spec import RLJobSpec
from rljob.operator.builders.router import router_args


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Start `args` in its own session (so stop() can signal its whole group), output to `log`."""
    handle = log.open("wb")
    return subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Poll `url` until it answers 200; fail with the log tail if the process dies or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited early:\n{log.read_text()[-3000:]}")
        try:
            # SGLang's /health_generate answers after >= 1 s (503 after its own 20 s window).
            if httpx.get(url, timeout=30.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready after {timeout} s:\n{log.read_text()[-3000:]}")


def stop(procs: list[subprocess.Popen[bytes]], timeout: float = 15) -> None:
    """SIGTERM every process group, then SIGKILL what is still alive after `timeout`."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def start_worker(
    model_dir: Path, log: Path, max_batch_size: int = 8, port: int | None = None, tp_size: int = 1,
    extra_args: tuple[str, ...] = (),
) -> tuple[str, subprocess.Popen[bytes]]:
    """One SGLang-protocol server process over the embedded engine; returns (url, process).
    ``port``: bind that one (a restart on the same address), else a free one. ``tp_size``: its
    tensor-parallel ranks in weight-update groups. ``extra_args``: more server flags (``--api-key K``)."""
    port = port or free_port()
    proc = spawn(
        [sys.executable, "-m", "rljob.runtime.engines.server", "--model-path", str(model_dir),
         "--host", "127.0.0.1", "--port", str(port), "--max-batch-size", str(max_batch_size),
         "--torch-threads", "1", "--log-level", "warning", "--tp-size", str(tp_size), *extra_args],
        log,
    )
    return f"http://127.0.0.1:{port}", proc


def start_workers(model_dir: Path, logs: Path, count: int, procs: list[subprocess.Popen[bytes]], *,
                  prefix: str = "w", max_batch_size: int = 8, ready_path: str = "/health",
                  timeout: float = 180, tp_size: int = 1, extra_args: tuple[str, ...] = ()) -> list[str]:
    """``count`` workers over ``model_dir``, each waited on until ``ready_path`` answers; returns their URLs.
    ``extra_args``: more server flags for each (start_worker).

    Each process is appended to ``procs`` as soon as it starts, so the caller's ``stop(procs)`` also
    stops the ones started before a later worker failed to come up. Logs: ``logs/<prefix><i>.log``.
    """
    urls = []
    for i in range(count):
        url, proc = start_worker(model_dir, logs / f"{prefix}{i}.log", max_batch_size=max_batch_size, tp_size=tp_size,
                                 extra_args=extra_args)
        urls.append(url)
        procs.append(proc)
    for i, url in enumerate(urls):
        wait_http(url + ready_path, timeout, procs[-count + i], logs / f"{prefix}{i}.log")
    return urls


def start_router(
    workers: list[str], log: Path, port: int | None = None, extra_args: tuple[str, ...] = ()
) -> tuple[str, subprocess.Popen[bytes]]:
    """The real sglang router (``sglang_router.launch_router``) over ``workers``; returns (url, process).
    ``extra_args``: more router flags (``--api-key K``).

    It runs with the operator's own flags (operator/builders/router.py: no health checks, no circuit
    breaker, no retries: the runtime, not the router, decides membership), on loopback, round robin, and
    with its Prometheus exporter on a free port (its default, 29000, may be taken by another test run).
    """
    port = port or free_port()
    spec = RLJobSpec.model_validate({"model": {"huggingFace": "x/y"}, "data": {"synthetic": {}},
                                     "rollout": {"router": {"policy": "round_robin"}}})
    args = router_args(spec)
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(port)
    proc = spawn(
        [sys.executable, "-m", "sglang_router.launch_router", *args, "--worker-urls", *workers,
         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn",
         *extra_args],
        log,
    )
    return f"http://127.0.0.1:{port}", proc
