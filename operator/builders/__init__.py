"""Pure builders: an RLJob spec in, the manifests of all its children out (no API calls)."""

from __future__ import annotations

from typing import Any

from rljob.api.spec import RLJobSpec
from rljob.operator.builders.inference import (
    effective_pools,
    pool_disruption_budget,
    pool_replicas,
    pool_service,
    pool_statefulset,
)
from rljob.operator.builders.images import ImageDefaults, apply_image_defaults
from rljob.operator.builders.meta import JobRef
from rljob.operator.builders.network import NetworkPolicySettings, network_policies
from rljob.operator.builders.pods import fall_back_to_logs
from rljob.operator.builders.router import router_deployment, router_service
from rljob.operator.builders.trainer import (
    checkpoint_pvc,
    config_map,
    role,
    role_binding,
    service_account,
    trainer_service,
    trainer_job,
)

__all__ = ["ImageDefaults", "JobRef", "NetworkPolicySettings", "build_children"]


_DEFAULT_NETWORK = NetworkPolicySettings()  # frozen: one shared default is safe


def build_children(
    job: JobRef, spec: RLJobSpec, *, active: bool, network: NetworkPolicySettings = _DEFAULT_NETWORK,
    images: ImageDefaults | None = None, serving: bool | None = None,
) -> list[dict[str, Any]]:
    """Every child object of one RLJob, in apply order (dependencies first).

    `active=False` (suspended or finished) keeps every object but scales all workloads to zero,
    so GPUs are released while the checkpoint PVC and the config survive. The NetworkPolicies come
    first, so no pod of the job ever runs unguarded. `images`: the operator's configured default images
    (None: the built-in ones). `serving`: whether the engines and the router keep their replicas (default:
    `active`); an inactive job keeps them while its trainer pods finish their step (lifecycle.engines_serve).
    """
    serving = active if serving is None else serving
    children: list[dict[str, Any]] = network_policies(job, spec, network)
    children += [config_map(job, spec), service_account(job), role(job), role_binding(job)]
    pvc = checkpoint_pvc(job, spec)
    if pvc is not None:
        children.append(pvc)
    counts = pool_replicas(spec.rollout)
    for pool in effective_pools(spec.rollout):
        children += [
            pool_service(job, pool),
            pool_disruption_budget(job, pool),
            pool_statefulset(job, spec, pool, counts[pool.name], serving),
        ]
    children += [router_service(job), router_deployment(job, spec, serving)]
    children += [trainer_service(job, spec), trainer_job(job, spec, active)]
    return apply_image_defaults(fall_back_to_logs(children), images or ImageDefaults())
