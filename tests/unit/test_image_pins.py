"""The NCCL pair: the CUDA trainer image installs the torch (and so the NCCL) of the default SGLang image.

Trainer rank 0 and the SGLang ranks share one NCCL communicator (weight transport `distributed`);
images/torch-pairs.toml says which torch each SGLang release runs. These tests read the Dockerfiles
and the operator's default SGLang version and fail when any of them drifts from that table.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from rljob.operator.builders.vendor import PROFILES, SGLANG_VERSION

ROOT = Path(__file__).resolve().parents[2]
PAIRS = ROOT / "images/torch-pairs.toml"
TRAINER_DOCKERFILE = ROOT / "images/runtime-cuda.Dockerfile"
SGLANG_DOCKERFILE = ROOT / "images/sglang-cuda.Dockerfile"


def build_args(dockerfile: str) -> dict[str, str]:
    """`ARG NAME=default` lines of a Dockerfile (the last one of a name wins, as in a later stage)."""
    return dict(re.findall(r"^ARG\s+([A-Z_]+)=(\S+)\s*$", dockerfile, flags=re.MULTILINE))


def pin_problems(pairs: dict[str, Any], sglang_version: str, sglang_dockerfile: str, trainer_dockerfile: str) -> list[str]:
    """Why the CUDA trainer image and the default SGLang image would bring different NCCL builds."""
    problems = []
    sglang_image = build_args(sglang_dockerfile).get("SGLANG_IMAGE", "")
    if sglang_image.rsplit(":", 1)[-1] != sglang_version:
        problems.append(f"sglang-cuda.Dockerfile builds on {sglang_image!r}, the operator defaults to {sglang_version}")
    row = pairs["sglang"].get(sglang_version)
    if row is None:
        return [*problems, f"images/torch-pairs.toml has no row for the default SGLang {sglang_version}"]
    trainer = build_args(trainer_dockerfile)
    if trainer.get("TORCH_VERSION") != row["torch"]:
        problems.append(
            f"runtime-cuda.Dockerfile installs torch {trainer.get('TORCH_VERSION')}, SGLang {sglang_version} runs torch "
            f"{row['torch']} (NCCL {row['nccl']}): set TORCH_VERSION={row['torch']}"
        )
    if not trainer.get("TORCH_INDEX_URL", "").rstrip("/").endswith("/" + row["cuda_wheels"]):
        problems.append(
            f"runtime-cuda.Dockerfile installs from {trainer.get('TORCH_INDEX_URL')}, SGLang {sglang_version}'s torch is "
            f"the {row['cuda_wheels']} build: use https://download.pytorch.org/whl/{row['cuda_wheels']}"
        )
    return problems


def pairs() -> dict[str, Any]:
    return tomllib.loads(PAIRS.read_text())


def test_the_trainer_image_brings_the_sglang_images_nccl() -> None:
    assert pin_problems(pairs(), SGLANG_VERSION, SGLANG_DOCKERFILE.read_text(), TRAINER_DOCKERFILE.read_text()) == []


def test_the_operators_default_image_is_the_pinned_release() -> None:
    assert PROFILES["nvidia"].sglang_image == f"lmsysorg/sglang:{SGLANG_VERSION}"


def test_every_row_names_torch_its_wheel_index_and_nccl() -> None:
    for release, row in pairs()["sglang"].items():
        assert set(row) == {"torch", "cuda_wheels", "nccl"}, release
        assert re.fullmatch(r"\d+\.\d+\.\d+", row["torch"]) and re.fullmatch(r"\d+\.\d+\.\d+", row["nccl"]), release
        assert re.fullmatch(r"cu1\d\d", row["cuda_wheels"]), release


def test_drift_is_caught_on_either_side() -> None:
    table = pairs()
    sglang, trainer = SGLANG_DOCKERFILE.read_text(), TRAINER_DOCKERFILE.read_text()
    # The default SGLang image moves to another supported release, the trainer image stays.
    moved = next(release for release in table["sglang"] if release != SGLANG_VERSION)
    moved_sglang = re.sub(r"(ARG SGLANG_IMAGE=lmsysorg/sglang:)\S+", rf"\g<1>{moved}", sglang)
    problems = pin_problems(table, moved, moved_sglang, trainer)
    assert any(f"set TORCH_VERSION={table['sglang'][moved]['torch']}" in p for p in problems), problems
    # The trainer's torch moves alone.
    bumped = re.sub(r"ARG TORCH_VERSION=\S+", "ARG TORCH_VERSION=0.0.1", trainer)
    assert any("installs torch 0.0.1" in p for p in pin_problems(table, SGLANG_VERSION, sglang, bumped))
    # The operator's default and the hardened image disagree; an unknown release has no row.
    assert any("operator defaults" in p for p in pin_problems(table, moved, sglang, trainer))
    assert any("no row" in p for p in pin_problems(table, "v9.9.9", sglang, trainer))
