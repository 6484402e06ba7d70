"""Generate the RLJob CustomResourceDefinition from the pydantic models (the one source of truth).

    python -m rljob.operator.crdgen           # write crds/rljob.io_rljobs.yaml
    python -m rljob.operator.crdgen --check   # exit 1 when the checked-in file is stale

Pydantic emits JSON Schema 2020-12; the API server wants a *structural* OpenAPI v3 schema: every node
typed, no $ref/$defs/anyOf-with-null/const/title, `exclusiveMinimum` as a boolean, and no
`additionalProperties: false` next to `properties` (unknown fields are pruned, or rejected by strict
field validation). Object fields that default to an empty model get `default: {}` so the API server
fills in the nested defaults and the stored object shows the effective configuration.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from rljob.api.spec import API_GROUP, API_VERSION, CLUSTER_RULES, KIND, MAX_JOB_NAME, RLJobSpec
from rljob.api.validation import DNS1035_LABEL_PATTERN
from rljob.api.status import RLJobStatus

log = logging.getLogger(__name__)

PLURAL = "rljobs"
SINGULAR = "rljob"
SHORT_NAMES = ["rlj"]
CATEGORIES = ["all", "rljob", "ml"]
CRD_PATH = Path(__file__).resolve().parent.parent / "crds" / f"{API_GROUP}_{PLURAL}.yaml"

# Keys of JSON Schema that OpenAPI v3 structural schemas do not accept (or we do not want).
_DROPPED_KEYS = {"title", "additionalProperties", "$defs", "discriminator"}

ROOT_RULES = [
    {
        "rule": f"self.metadata.name.size() <= {MAX_JOB_NAME} && "
        f"self.metadata.name.matches(r'{DNS1035_LABEL_PATTERN}')",
        "message": f"metadata.name must be a DNS-1035 label (lowercase letter first) of at most {MAX_JOB_NAME} "
        "characters: the operator derives Service and StatefulSet names from it",
    }
]

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.trainer.step"},
    {"name": "Rollout", "type": "string", "jsonPath": ".status.rollout.summary", "description": "ready/desired"},
    {"name": "Trainer", "type": "string", "jsonPath": ".status.trainer.summary", "description": "ready/desired"},
    {"name": "PolicyVer", "type": "integer", "jsonPath": ".status.trainer.policyVersion"},
    {"name": "OverSample", "type": "number", "jsonPath": ".status.effectiveKnobs.overSampling.value"},
    {"name": "TruncThr", "type": "number", "jsonPath": ".status.effectiveKnobs.truncation.value"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Entropy", "type": "number", "jsonPath": ".status.metrics.entropy", "priority": 1},
    {"name": "TruncRate", "type": "number", "jsonPath": ".status.metrics.truncationRate", "priority": 1},
]


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    """Inline $refs, recursively; sibling keys of a $ref (field description, CEL rules) win/append."""
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        siblings = {k: v for k, v in node.items() if k != "$ref"}
        rules = target.get("x-kubernetes-validations", []) + siblings.pop("x-kubernetes-validations", [])
        target.update(siblings)
        if rules:
            target["x-kubernetes-validations"] = rules
        return _resolve(target, defs)
    return {k: _resolve(v, defs) for k, v in node.items()}


def _strip_null_branch(node: dict[str, Any]) -> dict[str, Any]:
    """`X | None` becomes X: absent means unset (null values are pruned by the API server)."""
    branches = node.get("anyOf")
    if branches is None:
        return node
    non_null = [b for b in branches if b.get("type") != "null"]
    if len(non_null) != 1:
        raise ValueError(f"unions other than X | None cannot be expressed structurally: {branches}")
    merged = {k: v for k, v in node.items() if k != "anyOf"}
    rules = non_null[0].get("x-kubernetes-validations", []) + merged.pop("x-kubernetes-validations", [])
    merged = {**non_null[0], **merged}
    if rules:
        merged["x-kubernetes-validations"] = rules
    if merged.get("default", 0) is None:
        del merged["default"]
    return merged


def _key_rule(names: dict[str, Any]) -> dict[str, Any]:
    """CEL rule checking every key of a map against a `propertyNames` schema (pattern, maxLength)."""
    checks = []
    if "maxLength" in names:
        checks.append(f"k.size() <= {names['maxLength']}")
    if "minLength" in names:
        checks.append(f"k.size() >= {names['minLength']}")
    if "pattern" in names:
        checks.append(f"k.matches(r'{names['pattern']}')")  # raw string: regex escapes are not CEL escapes
    if not checks:
        raise ValueError(f"map keys with no checkable constraint: {names}")
    what = f"at most {names['maxLength']} characters" if "maxLength" in names else ""
    pattern = f"matching {names['pattern']}" if "pattern" in names else ""
    return {"rule": f"self.all(k, {' && '.join(checks)})", "message": f"keys must be {' '.join(filter(None, (what, pattern)))}"}


def to_structural(node: dict[str, Any], required: bool = True) -> dict[str, Any]:
    """Convert an inlined pydantic JSON schema node to a structural OpenAPI v3 schema node."""
    # `X | None = None` means "absent unless set": it must never be defaulted to {} below, or the
    # API server would set it on every object (and break exactly-one-of rules such as data's).
    nullable = any(b.get("type") == "null" for b in node.get("anyOf", []))
    node = _strip_null_branch(node)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED_KEYS:
            continue
        if key == "const":
            out["enum"] = [value]
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            bound = "minimum" if key == "exclusiveMinimum" else "maximum"
            out[bound] = value
            out[key] = True
        elif key == "properties":
            req = set(node.get("required", []))
            out["properties"] = {name: to_structural(sub, name in req) for name, sub in value.items()}
        elif key == "items":
            out["items"] = to_structural(value)
        elif key in ("propertyNames", "patternProperties"):
            continue  # map keys: see below
        else:
            out[key] = value
    if out.get("type") == "object" and "properties" not in out:
        extra = node.get("additionalProperties")
        names = dict(node.get("propertyNames") or {})
        if "patternProperties" in node:
            # pydantic puts a key pattern here, with the value schema under it.
            ((pattern, extra),) = node["patternProperties"].items()
            names["pattern"] = pattern
        if isinstance(extra, dict) and extra:
            out["additionalProperties"] = to_structural(extra)
        else:
            out["x-kubernetes-preserve-unknown-fields"] = True
        if names:
            # Structural schemas cannot constrain map keys: the same pattern and length as a CEL rule.
            out.setdefault("x-kubernetes-validations", []).append(_key_rule(names))
    if (
        not required
        and not nullable
        and out.get("type") == "object"
        and "properties" in out
        and "default" not in out
        and not out.get("required")  # the API server validates defaults: {} would lack the required keys
        and "x-kubernetes-validations" not in out  # ...and runs CEL rules on {} too ("no such key")
    ):
        # An optional sub-object with its own defaults: default it to {} so nested defaults apply.
        out["default"] = {}
    return out


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    """Structural OpenAPI schema of one pydantic model (camelCase, validation mode)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return to_structural(_resolve(raw, defs))


def _status_schema() -> dict[str, Any]:
    schema = model_schema(RLJobStatus)
    # kopf may write its own bookkeeping under status.kopf; keep it instead of pruning it (kopf#574).
    schema["properties"]["kopf"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return schema


def _spec_schema() -> dict[str, Any]:
    schema = model_schema(RLJobSpec)
    # Combinations only a cluster cannot run (a laptop `rljob run` accepts them): the CRD alone checks them.
    schema["x-kubernetes-validations"] = schema.get("x-kubernetes-validations", []) + CLUSTER_RULES
    return schema


def build_crd() -> dict[str, Any]:
    """The complete CustomResourceDefinition as a dict."""
    root = {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": _spec_schema(),
            "status": _status_schema(),
        },
        "x-kubernetes-validations": ROOT_RULES,
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{API_GROUP}",
            "labels": {"app.kubernetes.io/name": "rljob", "app.kubernetes.io/component": "crd"},
        },
        "spec": {
            "group": API_GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": CATEGORIES,
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.rollout.replicas",
                            "statusReplicasPath": ".status.rollout.ready",
                            "labelSelectorPath": ".status.rollout.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


def render_crd() -> str:
    """The CRD as the YAML text that is checked in."""
    header = "# Generated by `python -m rljob.operator.crdgen` from api/*.py. Do not edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: write the CRD, or with --check report whether it is stale."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(prog="python -m rljob.operator.crdgen", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the checked-in CRD differs")
    parser.add_argument("--output", type=Path, default=CRD_PATH)
    args = parser.parse_args(argv)
    text = render_crd()
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            log.error("%s is stale: run `python -m rljob.operator.crdgen`", args.output)
            return 1
        log.info("%s is up to date", args.output)
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    log.info("wrote %s (%d bytes)", args.output, len(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
