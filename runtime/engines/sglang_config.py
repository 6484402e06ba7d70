"""How the SGLang client finds its workers and how patient it is with them (spec.rollout.sglang)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from rljob.runtime.engines.http_retry import RetryPolicy


@dataclass
class SGLangClientConfig:
    """Where the workers are and how patient to be with them."""

    worker_urls: list[str] = field(default_factory=list)  # empty: ask `discover`, else the router
    router_url: str | None = None  # None: generate straight on the workers
    # Current worker URLs (the Kubernetes pods of the pools): re-asked before every weight update and
    # health check, so replicas added or removed by scaling join and leave without a restart.
    discover: Callable[[], Awaitable[list[str]]] | None = None
    # In-flight /generate calls per worker whose server info tells no capacity (engines/capacity.py:
    # a worker that does tell gets its own max running requests).
    worker_concurrency: int = 256
    retries: int = 4
    backoff_s: float = 0.25  # first retry delay; doubles up to backoff_max_s (with jitter)
    backoff_max_s: float = 4.0
    control_timeout_s: float = 30.0  # loads, aborts, health, info
    # Read timeout of one /generate (spec.rollout.sglang.requestTimeoutSeconds): a wedged worker can still
    # answer /health, so only this notices it. The request is then aborted there and retried elsewhere.
    generate_timeout_s: float = 600.0
    weight_update_timeout_s: float = 900.0
    health_timeout_s: float = 600.0  # start(): how long workers may take to come up
    drain_timeout_s: float = 120.0
    drain_poll_s: float = 0.2
    reabort_interval_s: float = 3.0
    probe_timeout_s: float = 2.0  # liveness/version probe (an info endpoint: never blocked by syncs)
    # start(): one /health_generate; SGLang answers it after >= 1 s, or 503 after its own 20 s window.
    health_generate_timeout_s: float = 30.0
    probe_interval_s: float = 1.0  # monitor: workers in the rotation and the router
    probe_backoff_s: float = 0.5  # monitor: first re-probe of a worker out of the rotation
    probe_backoff_max_s: float = 8.0
    manage_router: bool = True  # keep the router's worker list equal to the rotation
    router_add_grace_s: float = 10.0  # a worker the router accepted but does not list yet is posted again after this
    # A group's samples that start from its prompt: prime one worker with the prompt (a prefill-only
    # request), then send them all there, so it prefills the prompt once (prompt_groups.py).
    share_prefill: bool = True
    api_key: str | None = None  # the job's engine key: sent as a bearer token to workers and router (engines/auth.py)

    def retry_policy(self) -> RetryPolicy:
        """The HTTP retry policy of control calls (http_retry.py)."""
        return RetryPolicy(self.retries, self.backoff_s, self.backoff_max_s, self.control_timeout_s)
