"""Checkpoints in a real S3-compatible store (SeaweedFS on loopback, signed requests): save, resume from
the store on a fresh staging folder, fall back past a torn newest checkpoint, prune, export; and two
trainer pods (gloo ranks, each with its own staging folder) saving their parts and resuming from the store."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import obstore
import pytest
import torch
from transformers import AutoModelForCausalLM

from rljob.api import parse_rljob
from rljob.runtime.checkpoint import MARKER
from rljob.runtime.export import export_checkpoint
from rljob.runtime.object_store import ObjectStore, ObjectStoreError, ObjectUri, StoreSettings
from rljob.runtime.runner import JobRunner, RunOptions
from tests.helpers.object_store import S3Server
from tests.helpers.ranks import run_ranks
from tests.helpers.rewards import use_shorter_is_better
from tests.integration.test_distributed_training import _run_rank, assert_same_job_state
from tests.integration.test_runner_resume import job_doc, tiny_policy

@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The store's keys in the environment, as the operator passes them from a Secret."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server


def s3_job(model: Path, staging: Path, uri: str, endpoint: str, steps: int) -> dict:
    doc = job_doc(model, staging, steps=steps, every=1)
    doc["spec"]["checkpoint"].update({"uri": uri, "s3": {"endpoint": endpoint}})
    return doc


def folders(store: ObjectStore) -> dict[str, bool]:
    """Each step folder in the store, and whether it holds its completion marker."""
    return {name: store.exists(f"{name}/{MARKER}") for name in sorted(store.folders())}


def test_store_round_trip_and_errors_that_say_what_to_check(s3_env: S3Server, tmp_path: Path) -> None:
    store = ObjectStore(ObjectUri.parse(f"s3://{s3_env.bucket}/round-trip"))
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "a.bin").write_bytes(b"\x00" * 1000)
    (src / MARKER).write_text("done\n")
    store.upload_folder(src, "step-00000001", last=MARKER)
    assert folders(store) == {"step-00000001": True}
    assert sorted(store.keys("step-00000001")) == ["step-00000001/COMPLETE", "step-00000001/sub/a.bin"]
    store.download_folder("step-00000001", tmp_path / "copy")
    assert (tmp_path / "copy" / "sub" / "a.bin").read_bytes() == b"\x00" * 1000
    store.delete_folder("step-00000001")
    assert store.folders() == {}

    with pytest.MonkeyPatch.context() as mp:  # the keys come from the environment: make them wrong there
        mp.setenv("AWS_SECRET_ACCESS_KEY", "not-the-key")
        wrong = ObjectStore(ObjectUri.parse(f"s3://{s3_env.bucket}/x"), StoreSettings(retry_timeout_s=5))
    with pytest.raises(ObjectStoreError, match=r"checkpoint\.uri: could not list s3://.*AWS_ACCESS_KEY_ID"):
        wrong.folders()
    gone = ObjectStore(ObjectUri.parse(f"s3://{s3_env.bucket}/x"),
                       StoreSettings(endpoint="http://127.0.0.1:1", retry_timeout_s=3))
    with pytest.raises(ObjectStoreError, match=r"at http://127\.0\.0\.1:1.*reachable"):
        gone.folders()


async def test_save_resume_torn_fallback_prune_and_export(s3_env: S3Server, tmp_path: Path) -> None:
    model = tiny_policy(tmp_path / "model")
    uri = f"s3://{s3_env.bucket}/runs/resume"
    store = ObjectStore(ObjectUri.parse(uri))

    async def start(run: int) -> JobRunner:
        """A runner as on a fresh machine: its own, empty staging folder and output."""
        doc = s3_job(model, tmp_path / f"staging-{run}", uri, s3_env.endpoint, steps=6)
        runner = JobRunner(parse_rljob(doc), RunOptions(output_dir=tmp_path / f"out-{run}"))
        await runner.setup()
        return runner

    # First run: three steps, a checkpoint each, keep=2: the store holds steps 2 and 3, both marked.
    first = await start(1)
    assert first.resumed_from is None
    for _ in range(3):
        await first.run_step()
    await first.close()
    assert folders(store) == {"step-00000002": True, "step-00000003": True}

    # A second runner on a fresh machine (empty staging folder) resumes from the store's newest.
    second = await start(2)
    assert (second.step, second.version) == (3, 3)
    assert second.resumed_from == f"{uri}/step-00000003"
    assert second.skipped_checkpoints == []
    await second.close()

    # Tear the newest in the store the way a crash mid-upload does: its objects without the marker.
    obstore.delete(store._store, f"step-00000003/{MARKER}")  # noqa: SLF001 - the test plays the crash
    assert folders(store) == {"step-00000002": True, "step-00000003": False}
    third = await start(3)
    assert (third.step, third.version) == (2, 2)
    assert third.resumed_from == f"{uri}/step-00000002"
    assert third.skipped_checkpoints and third.skipped_checkpoints[0].startswith("step-00000003 (no completion marker")
    # Training on rewrites step 3 whole, then step 4 prunes step 2 from the store (keep=2).
    await third.run_step()
    await third.run_step()
    trained = {k: v.detach().clone() for k, v in third.trainer.model.state_dict().items()}
    await third.close()
    assert folders(store) == {"step-00000003": True, "step-00000004": True}

    # Export straight from the store: a prefix exports the newest complete checkpoint.
    result = export_checkpoint(uri, tmp_path / "hf")
    assert result.step == 4 and result.checkpoint == uri
    assert json.loads((tmp_path / "hf" / "rljob_export.json").read_text())["checkpoint"] == uri
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    shared = [k for k in trained if k in exported]
    assert shared, "no parameter names in common: the comparison would prove nothing"
    for key in shared:
        torch.testing.assert_close(exported[key], trained[key].to(exported[key].dtype))
    named = export_checkpoint(f"{uri}/step-00000003", tmp_path / "hf-3")
    assert named.step == 3


def _pod_rank(rank: int, doc: dict, out: Path, phase: str) -> None:
    """One trainer pod of one rank: its own staging folder (the pod's emptyDir), new for every phase."""
    doc = copy.deepcopy(doc)
    doc["spec"]["checkpoint"]["dir"] = str(out / "staging" / f"{phase}-pod-{rank}")
    _run_rank(rank, doc, out, phase)


def test_two_trainer_pods_upload_their_parts_and_resume_from_the_store(s3_env: S3Server, tmp_path: Path) -> None:
    uri = f"s3://{s3_env.bucket}/runs/two-pods"
    doc = s3_job(tiny_policy(tmp_path / "model"), tmp_path / "unused", uri, s3_env.endpoint, steps=3)
    doc["spec"]["checkpoint"]["everySteps"] = 2
    use_shorter_is_better(doc)  # AdamW moments that are not zero: the state compared means something
    run_ranks(_pod_rank, 2, doc, tmp_path, "save", pods=True)  # two steps, step 2 saved, then both pods end
    store = ObjectStore(ObjectUri.parse(uri))
    assert folders(store) == {"step-00000002": True}
    keys = {k.removeprefix("step-00000002/") for k in store.keys("step-00000002")}
    shards = {k for k in keys if k.endswith(".distcp")}
    assert len(shards) == 2, f"one DCP shard file per rank, each from its own pod: {sorted(keys)}"
    assert {"rng/rank-00000.pt", "rng/rank-00001.pt", "state.pt", MARKER} <= keys
    # Pod 1 staged only its own part, uploaded it and kept nothing: the store holds the only whole copy.
    pod1 = tmp_path / "staging" / "save-pod-1"
    assert not [p for p in pod1.rglob("*") if p.is_file()]
    assert sorted(p.name for p in (tmp_path / "staging" / "save-pod-0" / "step-00000002" / "rng").iterdir()) == [
        "rank-00000.pt"], "pod 0's staging folder held pod 1's files: the test would not show the upload"

    # Two new pods (empty staging folders) resume from the store: the same job state on every rank.
    run_ranks(_pod_rank, 2, doc, tmp_path, "resume", pods=True)
    saved = torch.load(tmp_path / "saved.pt", weights_only=False)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)
    assert_same_job_state(saved, resumed, "2 pods -> store -> 2 new pods")
    step, loss = resumed["next"]
    assert step == 3 and loss == loss
    assert folders(store) == {"step-00000002": True, "step-00000003": True}
    assert torch.load(tmp_path / "staging" / "resume-pod-0" / "step-00000003" / "state.pt",
                      weights_only=False)["world_size"] == 2
