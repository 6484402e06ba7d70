"""The pure parts of object-store checkpoints: s3:// URIs, what admission accepts, what pruning removes."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from rljob.api.spec import CheckpointSpec, RLJobSpec, cluster_problems
from rljob.runtime.checkpoint import plan_prune
from rljob.runtime.object_store import ObjectUri


@pytest.mark.parametrize(
    ("uri", "bucket", "prefix"),
    [("s3://ckpt", "ckpt", ""), ("s3://ckpt/", "ckpt", ""), ("s3://ckpt/a/b/", "ckpt", "a/b"), ("s3://ckpt//a", "ckpt", "a")],
)
def test_uri_splits_bucket_and_prefix(uri: str, bucket: str, prefix: str) -> None:
    parsed = ObjectUri.parse(uri)
    assert (parsed.bucket, parsed.prefix) == (bucket, prefix)
    assert ObjectUri.parse(str(parsed)) == parsed
    assert parsed.child("step-00000001").endswith("/step-00000001")


@pytest.mark.parametrize(("uri", "why"), [("s3:///x", "names no bucket"), ("gs://b/x", "not an s3://"),
                                          ("s3://b/a/../x", r"'\.\.'")])
def test_bad_uris_name_the_field(uri: str, why: str) -> None:
    with pytest.raises(ValueError, match=rf"checkpoint\.uri: .*{why}"):
        ObjectUri.parse(uri)


@pytest.mark.parametrize("uri", ["pvc://ckpt", "s3://ckpt-bucket", "s3://ckpt.bucket/runs/a"])
def test_admission_accepts_writable_uris(uri: str) -> None:
    assert CheckpointSpec(uri=uri).uri == uri


@pytest.mark.parametrize("uri", ["s3:/bucket/x", "runs/ckpt", "/mnt/ckpt", "gs://bucket/x", "s3://Bucket/x", "s3://ab"])
def test_admission_refuses_what_the_runtime_cannot_write(uri: str) -> None:
    with pytest.raises(ValidationError, match=r"uri[\s\S]*pvc://CLAIM or s3://BUCKET/PREFIX"):
        CheckpointSpec(uri=uri)


def test_s3_settings_need_an_s3_uri_and_any_number_of_trainer_pods_may_use_it() -> None:
    with pytest.raises(ValidationError, match=r"checkpoint\.s3 is set but checkpoint\.uri is not an s3://"):
        CheckpointSpec(uri="pvc://ckpt", s3={"endpoint": "http://minio:9000"})
    base = {"model": {"path": "pvc://models/m"}, "data": {"synthetic": {}}, "checkpoint": {"uri": "s3://ckpt/x"}}
    # Each pod stages its own part (tests/integration/test_checkpoint_object_store.py runs two).
    spec = RLJobSpec.model_validate({**base, "trainer": {"vendor": "cpu", "replicas": 2}})
    assert cluster_problems(spec) == []


def test_prune_keeps_the_newest_complete_and_newer_unmarked() -> None:
    listing = [(Path(f"step-{n:08d}"), marked) for n, marked in [(1, True), (2, False), (3, True), (4, True), (6, False)]]
    listing.append((Path("unrelated"), False))
    removed = plan_prune(listing, keep=2, newest=4)
    # step 1: beyond keep; step 2: torn and older than the newest; step 6: may be another writer's save.
    assert sorted(p.name for p in removed) == ["step-00000001", "step-00000002"]
