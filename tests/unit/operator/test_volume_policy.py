"""Pass-through pod volumes come from an allow-list (operator/volume_policy.py): the restricted set by
default, hostPath only when the chart allows it; the refusal names the field and the type."""

from __future__ import annotations

from typing import Any

import pytest

from rljob.api.spec import RLJobSpec
from rljob.operator.volume_policy import (
    ALLOWED_VOLUME_TYPES_ENV,
    RESTRICTED_VOLUME_TYPES,
    allowed_volume_types,
    refused_volume,
)


def _spec(*volumes: dict[str, Any]) -> RLJobSpec:
    return RLJobSpec.model_validate({"model": {"huggingFace": "x/y"}, "data": {"synthetic": {}},
                                     "pods": {"volumes": list(volumes)}})


def test_the_restricted_types_pass_by_default() -> None:
    spec = _spec({"name": "scratch", "emptyDir": {}}, {"name": "data", "persistentVolumeClaim": {"claimName": "d"}},
                 {"name": "cfg", "configMap": {"name": "c"}}, {"name": "tok", "projected": {"sources": []}})
    assert refused_volume(spec, allowed_volume_types({})) is None
    assert allowed_volume_types({}) == RESTRICTED_VOLUME_TYPES


@pytest.mark.parametrize("volume", [
    {"name": "host", "hostPath": {"path": "/"}},
    {"name": "nfs", "nfs": {"server": "10.0.0.1", "path": "/"}},
    {"name": "bare"},  # no source at all
])
def test_other_types_are_refused_naming_the_field(volume: dict[str, Any]) -> None:
    spec = _spec({"name": "ok", "emptyDir": {}}, volume)
    problem = refused_volume(spec, RESTRICTED_VOLUME_TYPES)
    assert problem is not None and problem.startswith(f"spec.pods.volumes[1] ({volume['name']})"), problem
    assert "pods.allowHostPath" in problem


def test_the_chart_can_allow_host_paths_or_narrow_the_list() -> None:
    host = _spec({"name": "host", "hostPath": {"path": "/data"}})
    allowed = allowed_volume_types({ALLOWED_VOLUME_TYPES_ENV: "emptyDir, hostPath"})
    assert allowed == {"emptyDir", "hostPath"} and refused_volume(host, allowed) is None
    narrow = allowed_volume_types({ALLOWED_VOLUME_TYPES_ENV: "emptyDir"})
    assert refused_volume(_spec({"name": "c", "configMap": {"name": "c"}}), narrow) is not None
    assert allowed_volume_types({ALLOWED_VOLUME_TYPES_ENV: ""}) == frozenset()
