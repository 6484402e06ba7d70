"""Weight transport: spec defaults and validation, bucketing, disk snapshots, the tensor mode, and
the ledger helper of the step records."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rljob.api import RLJobConfigError, parse_rljob
from rljob.runtime.engines.embedded import EmbeddedEngine
from rljob.runtime.engines.sglang_client import SGLangClientConfig, SGLangEngine
from rljob.runtime.metrics import ledger_imbalance
from rljob.runtime.step_record import RoundPart, StepRecord
from rljob.runtime.weight_group import lay_flat
from rljob.runtime.weights.disk import snapshots_to_delete, write_snapshot
from rljob.runtime.weights.broadcast import DistributedOptions, DistributedTransport, departed_members
from rljob.runtime.weights.buckets import bucket_bytes, module_buckets, with_last
from rljob.runtime.weights.tensor import TensorTransport
from tests.helpers.tiny_model import save_tiny_model
from tests.unit.test_config import quickstart


def rollout_of(**rollout: object):
    doc = quickstart()
    doc["spec"]["rollout"].update(rollout)
    return parse_rljob(doc, "job.yaml").spec.rollout


def test_default_transport_follows_the_engine():
    assert rollout_of(engine="embedded").transport_mode == "tensor"
    assert rollout_of(engine="sglang").transport_mode == "distributed"
    assert rollout_of(engine="sglang", weightTransport={"mode": "disk"}).transport_mode == "disk"


@pytest.mark.parametrize(
    ("engine", "mode"), [("sglang", "tensor"), ("embedded", "distributed"), ("embedded", "disk")]
)
def test_transport_that_cannot_reach_the_engine_is_named(engine, mode):
    with pytest.raises(RLJobConfigError, match=r"rollout.weightTransport.mode: " + mode):
        rollout_of(engine=engine, weightTransport={"mode": mode})


def test_bad_keep_last_is_named():
    with pytest.raises(RLJobConfigError, match=r"spec.rollout.weightTransport.keepLast"):
        rollout_of(engine="sglang", weightTransport={"mode": "disk", "keepLast": 0})


def test_buckets_cover_every_parameter_once_within_the_size(tmp_path: Path):
    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "m", seed=3))
    limit = 64 * 1024
    buckets = list(module_buckets(model, limit))
    names = [n for b in buckets for n, _ in b]
    assert names == [n for n, _ in model.named_parameters()]
    assert len(buckets) > 1
    for b in buckets:
        assert bucket_bytes(b) <= limit or len(b) == 1  # a single tensor larger than a bucket travels alone
    assert [last for _, last in with_last(buckets)] == [False] * (len(buckets) - 1) + [True]
    assert list(with_last([])) == []


def test_only_the_newest_snapshots_are_kept():
    names = ["v000003", "v000001", "v000010", "v000002", "notes", "v00000x"]
    assert snapshots_to_delete(names, 2) == ["v000001", "v000002"]
    assert snapshots_to_delete(names, 10) == []


def test_snapshot_loads_back_as_the_same_model(tmp_path: Path):
    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "m", seed=4))
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    folder = tmp_path / "weights" / "v000001"
    written = write_snapshot(folder, module_buckets(model, 64 * 1024), model.config.save_pretrained)
    assert written == sum(p.numel() * p.element_size() for p in model.parameters())
    assert not folder.with_name("v000001.tmp").exists()
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_snapshot_of_buckets_laid_flat_loads_back(tmp_path: Path):
    # A sharded trainer gathers each bucket as views of one buffer (training/fsdp.py): safetensors writes
    # such views as they are (it refuses only views that overlap), with no copy of the bucket.
    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "m", seed=6))
    buckets = []
    for bucket in module_buckets(model, 64 * 1024):
        laid = lay_flat([t.dtype for _, t in bucket], [t.shape for _, t in bucket], torch.device("cpu"))
        assert laid is not None
        for (_, tensor), view in zip(bucket, laid[1], strict=True):
            view.copy_(tensor)
        buckets.append([(name, view) for (name, _), view in zip(bucket, laid[1], strict=True)])
    folder = tmp_path / "weights" / "v000001"
    write_snapshot(folder, buckets, model.config.save_pretrained)
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


async def test_tensor_transport_moves_weights_and_version(tmp_path: Path):
    path = save_tiny_model(tmp_path / "m", seed=5)
    trainer = AutoModelForCausalLM.from_pretrained(path)
    engines = [EmbeddedEngine(path, max_batch_size=2, seed=i) for i in range(2)]
    for e in engines:
        await e.start()
    try:
        with torch.no_grad():
            for p in trainer.parameters():
                p.mul_(0.5)
        report = await TensorTransport(engines).sync(7, lambda _dtype: module_buckets(trainer, 32 * 1024))
        assert report.ok and len(report.updated) == 2 and not report.failed
        for e in engines:
            assert e.served_version() == 7
            served = dict(e.model.named_parameters())
            for name, param in trainer.named_parameters():
                assert torch.equal(param, served[name]), name
        bad = [[("no.such.weight", torch.zeros(1))]]
        report = await TensorTransport(engines).sync(8, lambda _dtype: bad)
        assert not report.ok and len(report.failed) == 2 and "no.such.weight" in next(iter(report.failed.values()))
        assert all(e.served_version() == 7 for e in engines), "a failed sync never moves the version"
    finally:
        for e in engines:
            await e.close()


async def test_tensor_transport_takes_both_names_of_a_tied_weight(tmp_path: Path):
    """A sharded trainer's full weights (its state dict, FSDP2Backend.iter_full_weights) name a tied output
    head beside its embedding; the embedded engine refused `lm_head.weight` of tiny-qwen3 (found by
    tests/gpu/smoke.py)."""
    from rljob.runtime.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "qwen3")
    trainer = AutoModelForCausalLM.from_pretrained(path)
    assert trainer.config.tie_word_embeddings and "lm_head.weight" not in dict(trainer.named_parameters())
    engine = EmbeddedEngine(path, max_batch_size=2)
    await engine.start()
    try:
        with torch.no_grad():
            trainer.get_input_embeddings().weight.mul_(0.5)
        state = [(n, t.detach()) for n, t in trainer.state_dict().items()]
        assert "lm_head.weight" in dict(state)
        report = await TensorTransport([engine]).sync(3, lambda _dtype: [state])
        assert report.ok and engine.served_version() == 3, report.failed
        assert torch.equal(engine.model.get_output_embeddings().weight, trainer.get_input_embeddings().weight)
    finally:
        await engine.close()


def test_ledger_helper_finds_a_missing_group():
    rec = StepRecord(step=1, policy_version=1, strategy="april", time=0.0, round=RoundPart(
        new_groups=5, buffer_groups_before=2, trained_groups=4, buffered_groups=2, filtered_groups=1, tokens_generated=100,
        buffer_tokens_before=10, trained_tokens=70, buffer_tokens_after=20, regenerated_tokens=5, filtered_tokens=15))
    assert ledger_imbalance(rec) == (0, 0)
    rec.round.buffered_groups = 1
    assert ledger_imbalance(rec) == (1, 0)


async def test_disk_transport_reports_an_unwritable_folder_and_consumes_the_source(tmp_path: Path):
    from rljob.runtime.engines.sglang_client import SGLangClientConfig, SGLangEngine
    from rljob.runtime.weights.disk import DiskTransport

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the snapshot folder should go")
    engine = SGLangEngine(SGLangClientConfig(worker_urls=["http://127.0.0.1:9"]))
    consumed = []

    def source(_dtype: torch.dtype | None):  # type: ignore[no-untyped-def]
        for i in range(3):
            consumed.append(i)
            yield [(f"w{i}", torch.zeros(4))]

    try:
        report = await DiskTransport([engine], blocker, 2, lambda _p: None).sync(1, source)
    finally:
        await engine.close()
    assert not report.ok and "diskDir" in report.failed["http://127.0.0.1:9"]
    assert consumed == [0, 1, 2], "every bucket is consumed even when the sync fails"


def test_group_members_that_left_discovery_are_departed() -> None:
    assert departed_members(["http://a", "http://b"], {"http://b", "http://c"}) == ["http://a"]
    assert departed_members(["http://a"], {"http://a"}) == []
    assert departed_members([], set()) == []


async def test_a_sync_after_a_group_member_left_discovery_reports_instead_of_crashing() -> None:
    # Regression (real node): the only engine pod was force-deleted; discovery dropped its worker, and
    # the next sync pushed to the old group and crashed trainer rank 0 looking the member up
    # ("coroutine raised StopIteration"). Now the group is dropped and the sync reports no engine.
    async def discover() -> list[str]:
        return []  # the pod is gone, its replacement not Ready yet

    engine = SGLangEngine(SGLangClientConfig(discover=discover, probe_timeout_s=0.2))
    transport = DistributedTransport([engine], DistributedOptions(master_address="127.0.0.1", backend="gloo"))
    # The state after an earlier sync to the departed worker; no group object: its rank is dead anyway.
    transport._members = ["http://127.0.0.1:9"]
    report = await transport.sync(2, lambda _dtype: iter([]))
    assert not report.ok and report.updated == [] and transport._members == []
