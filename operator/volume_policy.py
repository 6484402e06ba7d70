"""Which kinds of pod volume a job may pass through ``spec.pods.volumes`` (pure; reconcile applies it).

Without a rule, an RLJob editor could put a hostPath (or any volume type) into every child pod: the
same power as creating pods. The default allow-list is the Pod Security Standards' `restricted` set
(configMap, csi, downwardAPI, emptyDir, ephemeral, persistentVolumeClaim, projected, secret); the
chart's ``pods.allowedVolumeTypes`` replaces it and ``pods.allowHostPath`` adds hostPath, through the
operator's RLJOB_ALLOWED_VOLUME_TYPES (comma-separated).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from rljob.api.spec import RLJobSpec

RESTRICTED_VOLUME_TYPES = frozenset(
    {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
)
ALLOWED_VOLUME_TYPES_ENV = "RLJOB_ALLOWED_VOLUME_TYPES"


def allowed_volume_types(environ: Mapping[str, str] = os.environ) -> frozenset[str]:
    """The operator's allow-list: RLJOB_ALLOWED_VOLUME_TYPES, else the restricted set."""
    raw = environ.get(ALLOWED_VOLUME_TYPES_ENV)
    if raw is None:
        return RESTRICTED_VOLUME_TYPES
    return frozenset(t.strip() for t in raw.split(",") if t.strip())


def volume_types(volume: dict[str, Any]) -> set[str]:
    """The source fields of a Volume object (every key but its name)."""
    return set(volume) - {"name"}


def refused_volume(spec: RLJobSpec, allowed: frozenset[str]) -> str | None:
    """Why the spec's pass-through volumes may not be used (the first refused one, by field), or None."""
    for i, volume in enumerate(spec.pods.volumes):
        wire = volume.model_dump(by_alias=True, exclude_none=True)
        kinds = volume_types(wire)
        if not kinds or not kinds <= allowed:
            shown = ", ".join(sorted(kinds - allowed)) or "no volume source"
            return (f"spec.pods.volumes[{i}] ({wire['name']}): {shown} is not an allowed volume type here "
                    f"(allowed: {', '.join(sorted(allowed))}; the operator's chart values pods.allowedVolumeTypes "
                    "and pods.allowHostPath set them)")
    return None
