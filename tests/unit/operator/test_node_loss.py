"""Pods stuck Terminating on an unreachable node: when they are reported, and when they may be force-deleted."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from rljob.api.status import RLJobStatus
from rljob.operator.node_loss import (
    OUT_OF_SERVICE_TAINT,
    NodeObs,
    node_observation,
    stuck_pods,
    terminating_pod,
)
from tests.unit.operator.test_lifecycle import _cond, _obs, _run, _spec

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _pod(name: str = "demo-trainer-0-x", node: str | None = "gpu-7", deleting: bool = True, grace: int = 300) -> dict:
    meta: dict = {"name": name, "uid": f"uid-{name}"}
    if deleting:
        meta |= {"deletionTimestamp": "2026-01-01T00:05:00Z", "deletionGracePeriodSeconds": grace}
    return {"metadata": meta, "spec": {"nodeName": node} if node else {}}


def _node(ready: str | None, taints: list[str] = ()) -> dict:
    status = {"conditions": [{"type": "Ready", "status": ready}]} if ready else {}
    return {"metadata": {"name": "gpu-7"}, "spec": {"taints": [{"key": k, "effect": "NoExecute"} for k in taints]},
            "status": status}


def test_only_deleting_bound_pods_are_terminating_and_their_deletion_time_excludes_the_grace() -> None:
    pod = terminating_pod(_pod())
    assert pod is not None and pod.node == "gpu-7" and pod.deletion_requested == T0  # 00:05:00 less 300 s
    assert terminating_pod(_pod(deleting=False)) is None
    assert terminating_pod(_pod(node=None)) is None, "an unbound pod is removed by the API server at once"


def test_node_observation() -> None:
    assert node_observation("gpu-7", _node("True")) == NodeObs("gpu-7", "True", False)
    assert node_observation("gpu-7", _node("Unknown", [OUT_OF_SERVICE_TAINT])) == NodeObs("gpu-7", "Unknown", True)
    assert node_observation("gpu-7", _node(None)).ready == "Unknown", "a node that never reported"
    assert node_observation("gpu-7", None).ready == "Missing"
    assert not node_observation("gpu-7", _node("False", ["node.kubernetes.io/unreachable"])).out_of_service


def test_a_pod_is_stuck_only_on_a_node_that_is_not_ready_and_only_after_the_threshold() -> None:
    pod = terminating_pod(_pod())
    down = {"gpu-7": NodeObs("gpu-7", "Unknown")}
    assert stuck_pods([pod], down, T0 + timedelta(seconds=59), stuck_after_s=60) == []
    (stuck,) = stuck_pods([pod], down, T0 + timedelta(seconds=60), stuck_after_s=60)
    assert not stuck.force_delete
    assert "pod demo-trainer-0-x on node gpu-7 (Ready=Unknown)" in stuck.describe()
    assert f"once the node carries the {OUT_OF_SERVICE_TAINT} taint" in stuck.describe()
    # A Ready node's kubelet finishes the deletion itself, however long it takes; an unread node is not judged.
    assert stuck_pods([pod], {"gpu-7": NodeObs("gpu-7", "True", True)}, T0 + timedelta(hours=1), 60) == []
    assert stuck_pods([pod], {}, T0 + timedelta(hours=1), 60) == []
    (tainted,) = stuck_pods([pod], {"gpu-7": NodeObs("gpu-7", "False", True)}, T0 + timedelta(seconds=60), 60)
    assert tainted.force_delete and "force-deleting the pod" in tainted.describe()


def test_the_job_reports_the_stuck_pod_and_force_deletes_only_on_an_out_of_service_node() -> None:
    from rljob.operator import node_loss

    pod = terminating_pod(_pod())
    later = T0 + timedelta(seconds=node_loss.STUCK_AFTER_S)
    first = _run(_spec(), RLJobStatus(), _obs()).status
    obs = _obs(terminating_pods=[pod], nodes={"gpu-7": NodeObs("gpu-7", "Unknown")})
    d = _run(_spec(), first, obs, now=later)
    assert _cond(d.status, "NodeUnreachable") == ("True", "PodStuckTerminating") and d.force_delete == []
    (event,) = [e for e in d.events if e.reason == "PodStuckTerminating"]
    assert event.type == "Warning" and "demo-trainer-0-x" in event.message and "gpu-7" in event.message
    tainted = _obs(terminating_pods=[pod], nodes={"gpu-7": NodeObs("gpu-7", "Unknown", out_of_service=True)})
    d = _run(_spec(), d.status, tainted, now=later)
    assert d.force_delete == [pod] and "force-deleting" in d.status.condition("NodeUnreachable").message
    gone = _run(_spec(), d.status, _obs(), now=later)
    assert _cond(gone.status, "NodeUnreachable") == ("False", "NoPodStuck")
    assert [e.reason for e in gone.events] == ["NoPodStuck"] and gone.force_delete == []
