"""A real Prometheus server (Debian's binary) on loopback, scraping given loopback targets."""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.cluster.kube import wait_until

log = logging.getLogger(__name__)


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_loopback_target(target: str) -> str:
    """Return `target` ("host:port") if its host is loopback; raise ValueError otherwise."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"scrape target {target!r} must be host:port")
    host = host.strip("[]")
    if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
        raise ValueError(
            f"scrape target {target!r} is not on loopback; tests may only scrape 127.0.0.0/8 or ::1"
        )
    return target


def render_config(
    targets: Sequence[str],
    scrape_interval: str,
    job: str,
    metrics_path: str,
    rule_files: Sequence[Path],
) -> str:
    """Prometheus configuration (JSON, which is valid YAML) scraping `targets` in one job."""
    config: dict[str, Any] = {
        "global": {
            "scrape_interval": scrape_interval,
            "evaluation_interval": scrape_interval,
        },
        "scrape_configs": [
            {
                "job_name": job,
                "metrics_path": metrics_path,
                "scrape_timeout": scrape_interval,
                "static_configs": [
                    {"targets": [check_loopback_target(t) for t in targets]}
                ],
            }
        ],
    }
    if rule_files:
        config["rule_files"] = [str(p) for p in rule_files]
    return json.dumps(config, indent=2)


@dataclass
class PrometheusServer:
    """One Prometheus process; stop() and start() keep its port and storage, so its URL stays valid."""

    binary: Path
    workdir: Path
    config: str
    target_count: int
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:40123."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = 30.0) -> None:
        """Start (or start again) and wait for /-/ready."""
        if self.running:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(self.config)
        log_file = (self.workdir / "prometheus.log").open("ab")
        self.process = subprocess.Popen(
            [
                str(self.binary),
                f"--config.file={config_path}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log_file.close()
        wait_until(
            self._ready,
            timeout,
            f"Prometheus ready on {self.url} (log: {self.workdir / 'prometheus.log'})",
        )

    def stop(self, timeout: float = 15.0) -> None:
        """Stop gracefully (SIGTERM), killing after `timeout`; a no-op when not running."""
        if not self.running:
            return
        assert self.process is not None
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)

    def restart(self) -> None:
        """Stop and start again on the same port with the same data."""
        self.stop()
        self.start()

    def _ready(self) -> bool:
        if not self.running:
            raise RuntimeError(
                f"Prometheus exited with {self.process.returncode if self.process else None}; "
                f"see {self.workdir / 'prometheus.log'}"
            )
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Run an instant PromQL query and return the result vector."""
        resp = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        resp.raise_for_status()
        body = resp.json()
        if body.get("status") != "success":
            raise RuntimeError(f"query {expr!r} failed: {body}")
        return list(body["data"]["result"])

    def wait_for_targets_up(self, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Wait until every configured target has been scraped successfully; return the `up` samples."""

        def all_up() -> list[dict[str, Any]] | None:
            samples = self.query("up")
            if len(samples) < self.target_count or any(
                s["value"][1] != "1" for s in samples
            ):
                return None
            return samples

        return wait_until(
            all_up, timeout, f"all scrape targets up in {self.url}", interval=0.5
        )
