"""The checked-in CRD is generated from the API models and is a valid structural schema."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import yaml

from rljob.operator import crdgen

FORBIDDEN_KEYS = {"$ref", "$defs", "anyOf", "oneOf", "allOf", "const", "title", "nullable"}


def _walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if "items" in node:
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def _root() -> dict[str, Any]:
    return crdgen.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_checked_in_crd_is_up_to_date() -> None:
    assert crdgen.CRD_PATH.exists(), "run `python -m rljob.operator.crdgen`"
    assert crdgen.CRD_PATH.read_text() == crdgen.render_crd(), (
        "crds/rljob.io_rljobs.yaml is stale: run `python -m rljob.operator.crdgen`"
    )
    assert crdgen.main(["--check"]) == 0


def test_check_mode_detects_stale_file(tmp_path) -> None:
    stale = tmp_path / "crd.yaml"
    stale.write_text(crdgen.render_crd().replace("rlj", "xyz"))
    assert crdgen.main(["--check", "--output", str(stale)]) == 1


def test_schema_is_structural() -> None:
    for path, node in _walk(_root()):
        assert not FORBIDDEN_KEYS & node.keys(), f"{path}: {FORBIDDEN_KEYS & node.keys()}"
        assert "type" in node, f"{path} has no type"
        if node["type"] == "object" and "properties" in node:
            assert "additionalProperties" not in node, path
        if node["type"] == "array":
            assert "maxItems" in node, f"{path}: unbounded lists make CEL cost estimation fail"
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            assert node.get(bound, True) is True, f"{path}: {bound} must be a boolean in OpenAPI v3"


def test_preserve_unknown_fields_only_on_kopf_bookkeeping_and_pass_through_volumes() -> None:
    preserved = [p for p, n in _walk(_root()) if n.get("x-kubernetes-preserve-unknown-fields")]
    # spec.pods.volumes are Kubernetes Volume objects, validated by the API server in the pods.
    assert preserved == [".spec.pods.volumes[]", ".status.kopf"]
    volume = _root()["properties"]["spec"]["properties"]["pods"]["properties"]["volumes"]["items"]
    assert volume["required"] == ["name"]


def test_validation_rules_and_defaults() -> None:
    spec = _root()["properties"]["spec"]["properties"]
    rollout = spec["rollout"]["properties"]
    assert rollout["partial"]["properties"]["overSampling"]["minimum"] == 1.0
    assert rollout["rolloutBatchSize"]["minimum"] == 0 and rollout["rolloutBatchSize"]["exclusiveMinimum"] is True
    assert rollout["pools"]["items"]["properties"]["vendor"]["enum"] == ["nvidia", "amd", "cpu"]
    assert rollout["pools"]["x-kubernetes-list-type"] == "map"
    assert rollout["rolloutBatchSize"]["default"] == 8
    assert spec["algorithm"]["default"] == {}, "nested defaults apply only under a defaulted parent"
    model_rules = [r["rule"] for r in spec["model"]["x-kubernetes-validations"]]
    assert "self == oldSelf" in model_rules and any("huggingFace" in r for r in model_rules)
    for immutable in (spec["data"], spec["algorithm"]["properties"]["name"], rollout["samplesPerPrompt"]):
        assert {"rule": "self == oldSelf", "message": "field is immutable"} in immutable["x-kubernetes-validations"]
    assert _root()["properties"]["spec"]["required"] == ["model", "data"]


def test_subresources_names_and_columns() -> None:
    crd = crdgen.build_crd()
    names = crd["spec"]["names"]
    assert names["shortNames"] == ["rlj"] and names["kind"] == "RLJob"
    version = crd["spec"]["versions"][0]
    scale = version["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.rollout.replicas"
    status_props = _root()["properties"]["status"]["properties"]
    assert status_props["rollout"]["properties"]["selector"]["type"] == "string"
    assert status_props["rollout"]["properties"]["ready"]["type"] == "integer"
    assert status_props["conditions"]["x-kubernetes-list-map-keys"] == ["type"]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert list(columns)[:8] == ["Phase", "Step", "Rollout", "Trainer", "PolicyVer", "OverSample", "TruncThr", "Age"]
    assert columns["Entropy"]["priority"] == 1 and columns["TruncRate"]["priority"] == 1
    # Every printer column path must exist in the schema (a typo prints an empty column forever).
    for column in columns.values():
        if column["jsonPath"].startswith(".status"):
            node = _root()["properties"]["status"]
            for part in column["jsonPath"].split(".")[2:]:
                node = node["properties"][part]
            assert node["type"] == column["type"] or (column["type"], node["type"]) == ("number", "integer")


def test_crd_yaml_is_loadable_and_small() -> None:
    text = crdgen.CRD_PATH.read_text()
    assert yaml.safe_load(text)["metadata"]["name"] == "rljobs.rljob.io"
    assert len(text) < 262_144, "client-side kubectl apply fails above the annotation size limit"


def test_optional_objects_are_not_defaulted_into_existence() -> None:
    """`X | None = None` fields stay absent: a `default: {}` would set `data.synthetic` on every RLJob,
    and a JSONL job would then break the exactly-one-of rule on the API server."""
    data = _root()["properties"]["spec"]["properties"]["data"]
    assert "default" not in data["properties"]["synthetic"]
    assert data["properties"]["jsonl"]["type"] == "string"


def _spec_nodes(node: dict, path: str = "spec"):
    yield path, node
    for name, sub in (node.get("properties") or {}).items():
        yield from _spec_nodes(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _spec_nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _spec_nodes(node["additionalProperties"], f"{path}.*")


def test_every_spec_field_is_bounded() -> None:
    """Numbers have both bounds; strings, lists and maps a maximum size (CEL's cost estimate needs them)."""
    spec = crdgen.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    unbounded = []
    for path, node in _spec_nodes(spec):
        kind = node.get("type")
        if kind in ("integer", "number") and not ("minimum" in node and "maximum" in node):
            unbounded.append(f"{path}: {kind} without minimum and maximum")
        elif kind == "string" and "maxLength" not in node and "enum" not in node:
            unbounded.append(f"{path}: string without maxLength")
        elif kind == "array" and "maxItems" not in node:
            unbounded.append(f"{path}: array without maxItems")
        elif kind == "object" and "additionalProperties" in node and "maxProperties" not in node:
            unbounded.append(f"{path}: map without maxProperties")
    assert not unbounded, "\n".join(unbounded)
