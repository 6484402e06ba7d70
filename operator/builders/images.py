"""Where the child pods' default images come from: the operator's configuration (the chart's `images`).

The builders name the built-in defaults of operator/builders/vendor.py (`rljob/runtime:0.1.0-cuda`,
`lmsysorg/sglang:v0.5.23`, ...). A cluster pulls from its own registry: the chart gives the operator
an ImageDefaults (registry prefix, a repository, tag and digest per role, pull secrets) as JSON in
RLJOB_IMAGE_DEFAULTS, and `apply_image_defaults` puts the configured image wherever a built-in default
stands. An image the RLJob names itself (`trainer.image`, `pools[].image`, `router.image`,
`storage.download.image`) is no built-in default and stays as written.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rljob.operator.builders.pods import pod_templates
from rljob.operator.builders.vendor import PROFILES, ROUTER_IMAGE, TRAINER_IMAGES

IMAGE_DEFAULTS_ENV = "RLJOB_IMAGE_DEFAULTS"


class ImageRef(BaseModel):
    """One image: repository, tag and (optionally) digest, as the chart's values give it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    repository: str = Field(min_length=1, pattern=r"^[a-z0-9][a-z0-9._/:-]*$")
    tag: str = Field(default="", pattern=r"^([A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$")
    digest: str = Field(default="", pattern=r"^(sha256:[0-9a-f]{64})?$")

    @classmethod
    def parse(cls, ref: str) -> ImageRef:
        """`repo[:tag]` (a built-in default) as an ImageRef."""
        repository, _, tag = ref.rpartition(":") if ":" in ref.rsplit("/", 1)[-1] else (ref, "", "")
        return cls(repository=repository, tag=tag)

    def reference(self, registry: str) -> str:
        """`[registry/]repository[:tag][@digest]`: a digest pins the image, the tag is kept for reading."""
        name = f"{registry.rstrip('/')}/{self.repository}" if registry else self.repository
        return name + (f":{self.tag}" if self.tag else "") + (f"@{self.digest}" if self.digest else "")


def _builtin() -> dict[str, Any]:
    return {
        "trainer": {vendor: ImageRef.parse(ref) for vendor, ref in TRAINER_IMAGES.items()},
        "sglang": {vendor: ImageRef.parse(profile.sglang_image) for vendor, profile in PROFILES.items()},
        "router": ImageRef.parse(ROUTER_IMAGE),
        "download": ImageRef.parse(TRAINER_IMAGES["cpu"]),
    }


class ImageDefaults(BaseModel):
    """The images of the child pods of every RLJob, by role; the built-in defaults when nothing is configured."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    registry: str = Field(default="", pattern=r"^([a-z0-9][a-z0-9._:-]*(/[a-z0-9._-]+)*)?/?$",
                          description="Prefix of every repository, e.g. registry.example.com/mirror.")
    pull_secrets: tuple[str, ...] = Field(default=(), alias="pullSecrets")
    trainer: dict[str, ImageRef] = Field(default_factory=lambda: _builtin()["trainer"])
    sglang: dict[str, ImageRef] = Field(default_factory=lambda: _builtin()["sglang"])
    router: ImageRef = Field(default_factory=lambda: _builtin()["router"])
    download: ImageRef = Field(default_factory=lambda: _builtin()["download"])

    @field_validator("trainer", "sglang")
    @classmethod
    def _vendors(cls, value: dict[str, ImageRef], info: Any) -> dict[str, ImageRef]:
        """Every vendor of the role has an image (a partial map falls back to the built-in per vendor)."""
        unknown = set(value) - set(_builtin()[info.field_name])
        if unknown:
            raise ValueError(f"unknown vendors {sorted(unknown)}; known: {sorted(_builtin()[info.field_name])}")
        return {**_builtin()[info.field_name], **value}

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ImageDefaults:
        """The configured images (RLJOB_IMAGE_DEFAULTS, JSON), else the built-in ones.

        A configuration that does not validate stops the operator at start with the field named,
        rather than every child pod pulling an image nobody meant.
        """
        raw = (os.environ if environ is None else environ).get(IMAGE_DEFAULTS_ENV, "").strip()
        if not raw:
            return cls()
        try:
            return cls.model_validate(json.loads(raw))
        except (json.JSONDecodeError, ValidationError) as err:
            raise ValueError(f"{IMAGE_DEFAULTS_ENV}: {err}") from None

    def replacements(self) -> tuple[dict[str, str], dict[str, str]]:
        """(main containers, init containers): built-in default image -> configured image."""
        builtin = _builtin()
        main = {builtin["router"].reference(""): self.router.reference(self.registry)}
        for role in ("trainer", "sglang"):
            for vendor, ref in builtin[role].items():
                main[ref.reference("")] = getattr(self, role)[vendor].reference(self.registry)
        init = {builtin["download"].reference(""): self.download.reference(self.registry)}
        return main, init


def apply_image_defaults(children: list[dict[str, Any]], images: ImageDefaults) -> list[dict[str, Any]]:
    """Put the configured image wherever a built-in default stands, and the configured pull secrets
    (after the spec's own `pods.imagePullSecrets`) on every child pod."""
    main, init = images.replacements()
    for pod in pod_templates(children):
        for key, table in (("containers", main), ("initContainers", init)):
            for container in pod.get(key, []):
                container["image"] = table.get(container["image"], container["image"])
        if images.pull_secrets:
            have = [s["name"] for s in pod.get("imagePullSecrets", [])]
            pod["imagePullSecrets"] = [{"name": n} for n in dict.fromkeys([*have, *images.pull_secrets])]
    return children
