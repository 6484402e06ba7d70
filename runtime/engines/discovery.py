"""Find SGLang workers through the Kubernetes API: the ready pods carrying the job's inference labels.

The operator gives the runtime a label selector instead of a URL list, so scaling a pool changes no
config (and restarts no trainer). `worker_urls` is the pure selection; `PodWorkerDiscovery` does the
listing through `rljob.common.kube`.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import urllib3

from rljob.api.spec import PodDiscoverySpec
from rljob.common.kube import Kube, KubeError, load_api_client, selector_string

log = logging.getLogger(__name__)


class DiscoveryError(RuntimeError):
    """The pods could not be listed (after retries); the message says why and what to check."""


@dataclass(frozen=True)
class WorkerPod:
    """What selection needs to know about one pod."""

    name: str
    ip: str | None
    hostname: str | None
    subdomain: str | None
    ready: bool
    terminating: bool

    @classmethod
    def from_object(cls, pod: dict[str, Any]) -> WorkerPod:
        """Read a Pod object as the API server returns it."""
        meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        conditions = status.get("conditions") or []
        return cls(
            name=meta["name"],
            ip=status.get("podIP") or None,
            hostname=spec.get("hostname"),
            subdomain=spec.get("subdomain"),
            ready=status.get("phase") == "Running"
            and any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions),
            terminating=bool(meta.get("deletionTimestamp")),
        )


def worker_url(pod: WorkerPod, namespace: str, port: int) -> str:
    """The pod's stable DNS name behind its headless Service when it has one (a StatefulSet pod keeps it
    across restarts, so the runtime's per-worker state stays attached), else its IP."""
    if pod.hostname and pod.subdomain:
        return f"http://{pod.hostname}.{pod.subdomain}.{namespace}.svc:{port}"
    return f"http://{pod.ip}:{port}"


def worker_urls(pods: Iterable[dict[str, Any]], namespace: str, port: int) -> list[str]:
    """URLs of the pods that can serve now: Running and Ready, not being deleted, with an address.

    Sorted, so the same pods always give the same list.
    """
    chosen = [WorkerPod.from_object(p) for p in pods]
    return sorted(
        worker_url(p, namespace, port) for p in chosen if p.ready and not p.terminating and p.ip is not None
    )


class PodWorkerDiscovery:
    """An async callable returning the current worker URLs; list calls are retried with backoff."""

    def __init__(
        self, spec: PodDiscoverySpec, kube: Kube | None = None, retries: int = 4, backoff_s: float = 0.5
    ) -> None:
        self.spec = spec
        self._kube = kube
        self.retries = retries
        self.backoff_s = backoff_s

    def _client(self) -> Kube:
        if self._kube is None:
            # In-cluster ServiceAccount credentials (the trainer Role may list pods), else KUBECONFIG.
            self._kube = Kube(load_api_client())
        return self._kube

    def _list(self) -> list[dict[str, Any]]:
        return self._client().list("v1", "Pod", self.spec.namespace, selector_string(self.spec.selector))

    async def __call__(self) -> list[str]:
        """Worker URLs of the ready pods now; DiscoveryError when the API server keeps failing."""
        last = ""
        for attempt in range(self.retries + 1):
            try:
                pods = await asyncio.to_thread(self._list)
            except KubeError as exc:
                if exc.status in (401, 403):
                    raise DiscoveryError(
                        f"listing pods in {self.spec.namespace} was refused ({exc}): the trainer's Role must allow "
                        "get/list/watch on pods"
                    ) from exc
                last = str(exc)
            except (OSError, urllib3.exceptions.HTTPError) as exc:  # connection refused/reset, DNS, TLS
                last = f"{type(exc).__name__}: {exc}"
            else:
                return worker_urls(pods, self.spec.namespace, self.spec.port)
            if attempt < self.retries:
                delay = self.backoff_s * (2**attempt) * (0.5 + random.random() / 2)
                log.warning("listing SGLang worker pods failed (%s); retrying in %.1f s", last, delay)
                await asyncio.sleep(delay)
        raise DiscoveryError(
            f"cannot list the SGLang worker pods ({selector_string(self.spec.selector)}) in "
            f"{self.spec.namespace} after {self.retries + 1} attempts: {last}"
        )
