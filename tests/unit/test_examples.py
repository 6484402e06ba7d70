"""Every shipped example (the chart's examples/ and docs/examples/) passes `rljob validate --cluster` and
renders through the operator's own builders (pure functions, no cluster); each example's header comment
names every claim, Secret and node label its pods need."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob.api.load import load_rljob, parse_rljob
from rljob.api.spec import cluster_problems
from rljob.operator.builders.engine_key import engine_key_secret_name
from rljob.operator.builders import JobRef, build_children
from rljob.operator.builders.pods import pod_templates
from rljob.operator.builders.trainer import checkpoint_pvc

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted([*ROOT.glob("charts/rljob-operator/examples/*.yaml"), *ROOT.glob("docs/examples/*.yaml")])


def _header(path: Path) -> str:
    """The comment block before the document."""
    lines = path.read_text().splitlines()
    return "\n".join(line for line in lines[: next(i for i, l in enumerate(lines) if not l.startswith("#"))])


def _needs(children: list[dict[str, Any]]) -> tuple[set[str], set[str], set[str]]:
    """(claims, Secrets, node label keys) the pods of `children` use, the operator's own claim excluded."""
    own = {c["metadata"]["name"] for c in children if c["kind"] == "PersistentVolumeClaim"}
    claims, secrets, labels = set(), set(), set()
    for pod in pod_templates(children):
        claims |= {v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
        labels |= set(pod.get("nodeSelector", {}))
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            secrets |= {e["valueFrom"]["secretKeyRef"]["name"] for e in container.get("env", [])
                        if "secretKeyRef" in e.get("valueFrom", {})}
    return claims - own, secrets, labels


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_example_validates_for_a_cluster_and_renders(example: Path) -> None:
    job = load_rljob(example)
    assert cluster_problems(job.spec) == [], example.name
    ref = JobRef(job.metadata.name, "ml", "uid-1")
    children = build_children(ref, job.spec, active=True)
    pods = pod_templates(children)
    assert {c["kind"] for c in children} >= {"ConfigMap", "StatefulSet", "Deployment", "Job"}
    assert len(pods) == len(job.spec.rollout.pools or [None]) + 2  # every pool, the router, the trainer
    for pod in pods:
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            assert container["image"] and container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    # The trainer pods all mount the checkpoint claim: its access mode must serve them all.
    pvc = checkpoint_pvc(ref, job.spec)
    if pvc is not None and job.spec.trainer.replicas > 1:
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"], example.name


@pytest.mark.parametrize("example", [p for p in EXAMPLES if "charts" in p.parts], ids=lambda p: p.name)
def test_example_header_lists_what_its_pods_need(example: Path) -> None:
    job = load_rljob(example)
    ref = JobRef(job.metadata.name, "ml", "u")
    claims, secrets, labels = _needs(build_children(ref, job.spec, active=True))
    secrets.discard(engine_key_secret_name(ref))  # the operator creates it (ensure_engine_key)
    header = _header(example)
    missing = [f"claim {c}" for c in claims if f"`{c}`" not in header]
    missing += [f"Secret {s}" for s in secrets if f"`{s}`" not in header]
    missing += [f"node label {k}" for k in labels if k not in header]
    assert not missing, f"{example.name}: the header comment does not name {missing}"


def test_operator_doc_sample_validates_for_a_cluster() -> None:
    """docs/operator.md's RLJob sample is what a reader copies first: it must run on a cluster too."""
    text = (ROOT / "docs/operator.md").read_text()
    samples = [b.split("```", 1)[0] for b in text.split("```yaml\n")[1:] if "kind: RLJob" in b.split("```", 1)[0]]
    assert samples, "docs/operator.md has no RLJob sample"
    for sample in samples:
        document = yaml.safe_load(sample)
        assert cluster_problems(parse_rljob(document, "docs/operator.md").spec) == [], sample
