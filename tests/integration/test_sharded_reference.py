"""The KL reference of a multi-rank job is sharded like the policy, and its log-probs are the unsharded ones.

Two real gloo ranks build a `Trainer` with `klCoef > 0` over the same float64 tiny transformer. Each rank
must hold only its shard of the reference (FSDP2 DTensors, about half of every weight), and the
reference log-probs both ranks compute for one batch must match those a single process computes with
the whole reference model. float64, and the same micro-batches on every side: the only differences
are summation orders inside the gathered layers, far below 1e-10 (a wrong or missing shard moves a
log-prob by whole units).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from rljob.api.spec import AlgorithmSpec
from rljob.runtime.rollout.sample import Group, Sample, SampleStatus
from rljob.runtime.trainer import Trainer
from tests.helpers.ranks import run_ranks
from tests.helpers.tiny_model import TINY_VOCAB, build_tiny_model

SPEC = AlgorithmSpec(learning_rate=1e-2, kl_coef=0.1)


def batch() -> list[Group]:
    rng = random.Random(11)
    groups = []
    for g in range(3):
        prompt = [rng.randrange(1, TINY_VOCAB) for _ in range(rng.randint(3, 7))]
        samples = []
        for i in range(2):
            response = [rng.randrange(1, TINY_VOCAB) for _ in range(rng.randint(2, 12))]
            samples.append(Sample(group_id=f"g{g}", index=i, prompt_ids=prompt, answer="", response_ids=response,
                                  status=SampleStatus.COMPLETED, logprobs=[-1.0] * len(response),
                                  versions=[0] * len(response), reward=rng.random()))
        groups.append(Group(group_id=f"g{g}", prompt_text="", samples=samples))
    return groups


def reference_logps(trainer: Trainer) -> list[torch.Tensor]:
    items, _ = trainer._items(batch(), policy_version=0)  # noqa: SLF001
    trainer._fill_logps(items, old=False)  # noqa: SLF001
    return [it.ref_logp for it in items]  # type: ignore[misc]


def _on_ranks(rank: int, out: Path) -> None:
    from torch.distributed.tensor import DTensor

    from rljob.runtime.training.distributed import DistEnv, Distributed

    env = DistEnv.from_environ()
    assert env is not None
    trainer = Trainer(build_tiny_model(seed=0).double(), SPEC, micro_batch_size=2, distributed=Distributed(env, "cpu"))
    assert trainer.reference is not None
    params = list(trainer.reference.model.parameters())
    local = sum(p.to_local().numel() for p in params if isinstance(p, DTensor))
    full = sum(p.numel() for p in params)
    logps = reference_logps(trainer)
    if rank == 0:
        torch.save({"logps": logps, "local": local, "full": full,
                    "all_sharded": all(isinstance(p, DTensor) for p in params)}, out / "rank0.pt")


def test_two_ranks_shard_the_reference_and_get_the_unsharded_log_probs(tmp_path: Path) -> None:
    run_ranks(_on_ranks, 2, tmp_path)
    result = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert result["all_sharded"], "some reference weights are not FSDP2 shards"
    assert result["local"] <= 0.6 * result["full"], (
        f"rank 0 holds {result['local']} of the reference's {result['full']} elements: it is not sharded")
    expected = reference_logps(Trainer(build_tiny_model(seed=0).double(), SPEC, micro_batch_size=2))
    got = result["logps"]
    assert len(got) == len(expected) > 0
    worst = max(float((g - e).abs().max()) for g, e in zip(got, expected, strict=True))
    assert worst <= 1e-10, f"sharded reference log-probs differ from the unsharded ones by up to {worst:.3g}"
    assert max(float(e.abs().max()) for e in expected) > 1.0, "the log-probs are trivial: the check proves nothing"
