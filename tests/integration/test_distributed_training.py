"""Data-parallel training on real gloo ranks (spawned processes on loopback) with a real tiny transformer.

Equivalence. On a fixed batch, 2 FSDP2 ranks (each trains the groups `balance_by_tokens` gives it)
must compute the loss and, after the AdamW update, the weights that one process computes on the
whole batch. The model is float64, so the only differences are rounding in a different summation
order: the loss and gradient sums are split over ranks and added by the reduce-scatter, and the
micro-batches are cut differently (different padding widths, hence different kernels' blocking).
Each such sum of n terms differs by at most about n·u relatively, u = 2^-53 ≈ 1.1e-16; with n
below 1e4 terms per sum that is below 1e-12. The loss inherits that: rtol 1e-9 leaves three
orders of margin. The weights: after one AdamW step from zero moments the update is
lr·g/(|g|+ε) per element, whose error for a gradient error δg is lr·δg·ε/(|g|+ε)² ≤ lr·(δg/|g|)/4,
so at most lr·1e-12/4 = 2.5e-15 for lr 1e-2; the gradient-clipping scale and weight decay add
rounding of the same order. atol 1e-11 on weights of order 1 leaves more than three orders of
margin, while any real mistake (a missing all-reduce of the denominator halves or doubles a
gradient; a dropped shard drops whole rows) moves weights by about lr = 1e-2.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch

from rljob.api.spec import AlgorithmSpec
from rljob.runtime.rollout.sample import Group, Sample, SampleStatus
from rljob.runtime.trainer import Trainer
from rljob.runtime.training.balance import balance_by_tokens
from tests.helpers.ranks import run_ranks
from tests.helpers.rewards import use_shorter_is_better
from tests.helpers.tiny_model import TINY_VOCAB, build_tiny_model

SPEC = AlgorithmSpec(learning_rate=1e-2, max_grad_norm=1.0)
MICRO_BATCH = 2
LOSS_RTOL = 1e-9
WEIGHT_ATOL = 1e-11


def fixed_batch(groups: int, seed: int = 7) -> list[Group]:
    """Groups of 2-3 samples with varied prompt and response lengths and rewards (deterministic)."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(1, TINY_VOCAB) for _ in range(rng.randint(3, 8))]
        samples = []
        for i in range(rng.randint(2, 3)):
            n = rng.randint(2, 14)
            samples.append(Sample(
                group_id=f"g{g}", index=i, prompt_ids=prompt, answer="", status=SampleStatus.COMPLETED,
                response_ids=[rng.randrange(1, TINY_VOCAB) for _ in range(n)],
                logprobs=[-rng.uniform(1.0, 6.0) for _ in range(n)], versions=[0] * n, reward=rng.random(),
            ))
        out.append(Group(group_id=f"g{g}", prompt_text="", samples=samples))
    return out


def tokens(group: Group) -> int:
    return sum(len(s.prompt_ids) + len(s.response_ids) for s in group.samples)


def float64_model() -> torch.nn.Module:
    return build_tiny_model(seed=0).to(torch.float64)


def _train_on_ranks(rank: int, out: Path, batches: list[int]) -> None:
    from rljob.runtime.training.distributed import DistEnv, Distributed

    env = DistEnv.from_environ()
    assert env is not None and env.rank == rank
    distributed = Distributed(env, "cpu")
    for n_groups in batches:
        trainer = Trainer(float64_model(), SPEC, micro_batch_size=MICRO_BATCH, distributed=distributed)
        groups = fixed_batch(n_groups)
        shards = balance_by_tokens([tokens(g) for g in groups], env.world_size)
        mine = distributed.scatter([[groups[i] for i in s] for s in shards] if rank == 0 else None)
        metrics = trainer.train_step(mine, policy_version=0)
        weights = {n: t.clone() for bucket in trainer.backend.iter_full_weights(1 << 16) for n, t in bucket}
        if rank == 0:
            torch.save({"metrics": metrics.to_dict(), "weights": weights, "shards": shards}, out / f"{n_groups}.pt")
        else:
            assert weights == {}, "iter_full_weights gave a bucket to a rank other than 0"


@pytest.mark.parametrize("n_groups", [5])
def test_two_gloo_ranks_take_the_update_of_one_process(tmp_path: Path, n_groups: int) -> None:
    # 5 groups: the ranks get unequal micro-batch counts (padding passes); 1 group: rank 1 trains nothing.
    run_ranks(_train_on_ranks, 2, tmp_path, [n_groups, 1])
    for count in (n_groups, 1):
        result = torch.load(tmp_path / f"{count}.pt", weights_only=False)
        model = float64_model()
        reference = Trainer(model, SPEC, micro_batch_size=MICRO_BATCH).train_step(fixed_batch(count), policy_version=0)
        got = result["metrics"]
        if count > 1:
            assert all(result["shards"]), "a rank got no group: the test would not exercise the split"
        assert got["samples"] == reference.samples and got["tokens"] == reference.tokens
        assert got["loss"] == pytest.approx(reference.loss, rel=LOSS_RTOL, abs=1e-14)
        assert got["grad_norm"] == pytest.approx(reference.grad_norm, rel=LOSS_RTOL)
        assert reference.optimizer_steps == got["optimizer_steps"] == 1
        expected = model.state_dict()
        assert result["weights"].keys() == expected.keys()
        worst = max(float((result["weights"][k] - v).abs().max()) for k, v in expected.items())
        assert worst <= WEIGHT_ATOL, f"weights differ by up to {worst:.3g} after the update"
        moved = max(float((v - float64_model().state_dict()[k]).abs().max()) for k, v in expected.items())
        assert moved > 1e3 * WEIGHT_ATOL, "the update did not move the weights: the comparison proves nothing"


UNEVEN = {"vocab_size": 4, "hidden_size": 40}  # 3 ranks: 4 rows split 2/2/0 (an empty shard), 40 rows 14/14/12


def _gather_on_ranks(rank: int, out: Path) -> None:
    from rljob.runtime.training.distributed import DistEnv, Distributed
    from rljob.runtime.training.fsdp import FSDP2Backend

    env = DistEnv.from_environ()
    assert env is not None
    backend = FSDP2Backend(build_tiny_model(seed=5, **UNEVEN), 1e-3, 0.0, Distributed(env, "cpu"))
    buckets = list(backend.iter_full_weights(1 << 12))  # small buckets: many, some holding several tensors
    # Rank 0 alone names the wire dtype, as in a sync (the others join it after training, untold).
    halves = list(backend.iter_full_weights(1 << 12, torch.bfloat16 if rank == 0 else None))
    if rank == 0:
        torch.save({n: t.clone() for bucket in buckets for n, t in bucket}, out / "weights.pt")
        torch.save({n: t.clone() for bucket in halves for n, t in bucket}, out / "bf16.pt")
        shared = [list({id(t): t for _, t in b}.values()) for b in halves]  # buckets of several tensors
        sizes = [sum(t.numel() * t.element_size() for t in ts) for ts in shared if len(ts) > 1]
        (out / "bf16_bucket_bytes.txt").write_text(" ".join(map(str, sizes)))
    else:
        assert buckets == halves == [], "iter_full_weights gave a bucket to a rank other than 0"


def test_three_ranks_with_uneven_and_empty_shards_give_rank_0_the_exact_weights_in_the_asked_dtype(tmp_path: Path) -> None:
    # Rank 0 receives each shard straight into its rows of the full tensor (fsdp._rows_of): a wrong
    # split of uneven rows, or a rank past the last row, would misplace or drop rows.
    run_ranks(_gather_on_ranks, 3, tmp_path)
    got = torch.load(tmp_path / "weights.pt")
    expected = build_tiny_model(seed=5, **UNEVEN).state_dict()
    assert list(got) == list(expected)
    assert [n for n, t in expected.items() if not torch.equal(got[n], t)] == []
    # In bfloat16 every rank sends its shard cast: the exact cast of the full tensor, in half the buckets.
    halves = torch.load(tmp_path / "bf16.pt")
    assert list(halves) == list(expected)
    assert [n for n, t in expected.items() if not torch.equal(halves[n], t.to(torch.bfloat16))] == []
    sizes = [int(n) for n in (tmp_path / "bf16_bucket_bytes.txt").read_text().split()]
    # Cut by fp32 bytes, no bucket of several bf16 tensors would pass half a bucket (2 KiB).
    assert sizes and 1 << 11 < max(sizes) <= 1 << 12, sizes


# ---------------------------------------------------------------------------------------------
# resharding: a checkpoint resumes at another world size (2 -> 1, 2 -> 4, and a bf16 one of 1 -> 2)


def full_state(trainer: Trainer) -> dict:
    """The whole (unsharded) model and AdamW state of a trainer in DCP's layout: {"model": {name: tensor},
    "optim": {name: {"step", "exp_avg", "exp_avg_sq"}}}. Collective under FSDP2 (rank 0 gets it, the
    others {}); in one process a copy of the checkpoint state (the fp32 masters with bf16 parameters)."""
    if trainer.backend.world_size == 1:
        state = copy.deepcopy(trainer.checkpoint_state())
        return {"model": state["model"], "optim": state["optim"]["state"]}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, optim = get_state_dict(trainer.backend.model, trainer.backend.optimizer,
                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # A copy: the AdamW step counts are plain tensors, handed out as the live ones, which the next
    # optimizer step would advance in place.
    return copy.deepcopy({"model": model, "optim": optim["state"]}) if trainer.backend.rank == 0 else {}


def snapshot(groups) -> dict:  # type: ignore[no-untyped-def]
    return {g.group_id: [(s.index, tuple(s.response_ids), tuple(s.versions)) for s in g.samples] for g in groups}


def leader_record(runner) -> dict:  # type: ignore[no-untyped-def]
    """What rank 0 holds of a run: buffer, data cursor, counters, and the engine's weights (which are
    the gathered full weights of the last sync: fp32 engine, tensor transport)."""
    return {"buffer": snapshot(runner.scheduler.buffer), "cursor": runner.prompts.state_dict(),
            "engine": {k: v.clone() for k, v in runner.engines[0].model.state_dict().items()},
            "step": runner.step, "version": runner.version, "steps_done": runner.trainer.steps_done}


def _ranks_train_then_stop(distributed, job, lead, stops: int) -> None:  # type: ignore[no-untyped-def]
    """Every rank's part of a run in which rank 0 runs `lead(job, distributed)` (async): ranks 1..N-1
    follow its orders, and after each of its `stops` "stop" orders join one gather of the full state."""
    import asyncio

    from rljob.runtime.ranks import TrainingRank

    if distributed.rank != 0:
        training = TrainingRank(job, distributed)
        for _ in range(stops):
            training.run()
            full_state(training.trainer)
        return
    asyncio.run(lead(job, distributed))


def _stop_and_gather(runner) -> dict:  # type: ignore[no-untyped-def]
    from rljob.runtime.ranks import Order

    runner.orders.send(Order("stop"))
    return full_state(runner.trainer)


async def _lead_two_steps(job, distributed, out: Path) -> None:  # type: ignore[no-untyped-def]
    from rljob.runtime.runner import JobRunner, RunOptions

    runner = JobRunner(job, RunOptions(output_dir=out / "saved"), distributed)
    await runner.setup()
    for _ in range(2):
        await runner.run_step()  # checkpoint.everySteps 2: step 2 is saved by every rank
    record = leader_record(runner)
    record["state"] = _stop_and_gather(runner)
    await runner.close()
    torch.save(record, out / "saved.pt")


async def _lead_resume_and_step(job, distributed, out: Path) -> None:  # type: ignore[no-untyped-def]
    from rljob.runtime.runner import JobRunner, RunOptions

    runner = JobRunner(job, RunOptions(output_dir=out / "resumed"), distributed)
    await runner.setup()  # resumes from the newest checkpoint
    record = leader_record(runner)
    record["state"] = _stop_and_gather(runner)
    step = await runner.run_step()  # and the job trains on from there, at its own world size
    record["next"] = (step.step, step.train.loss)
    _stop_and_gather(runner)
    await runner.close()
    torch.save(record, out / "resumed.pt")


async def _lead_a_catch_up(job, distributed, out: Path) -> None:  # type: ignore[no-untyped-def]
    from rljob.runtime.runner import JobRunner, RunOptions

    runner = JobRunner(job, RunOptions(output_dir=out / "caught-up"), distributed)
    await runner.setup()
    await runner.run_step()  # the engine serves version 1, gathered from both ranks
    with torch.no_grad():  # as if the engine had restarted with other weights
        for param in runner.engines[0].model.parameters():
            param.zero_()
    await runner.resync_weights()  # the catch-up: rank 1 must join its gather, or this hangs
    record = leader_record(runner)
    record["state"] = _stop_and_gather(runner)
    await runner.close()
    torch.save(record, out / "caught-up.pt")


def _run_rank(rank: int, doc: dict, out: Path, phase: str) -> None:
    from functools import partial

    from rljob.api import parse_rljob
    from rljob.runtime.training.distributed import DistEnv, Distributed

    env = DistEnv.from_environ()
    assert env is not None and env.rank == rank
    fn, stops = {"save": (_lead_two_steps, 1), "resume": (_lead_resume_and_step, 2),
                 "catch-up": (_lead_a_catch_up, 1)}[phase]
    _ranks_train_then_stop(Distributed(env, "cpu"), parse_rljob(doc), partial(fn, out=out), stops)


async def _save_in_one_process(doc: dict, out: Path) -> None:
    from rljob.api import parse_rljob
    from rljob.runtime.runner import JobRunner, RunOptions

    runner = JobRunner(parse_rljob(doc), RunOptions(output_dir=out / "saved"))
    await runner.setup()
    try:
        for _ in range(2):
            await runner.run_step()
        record = leader_record(runner)
        record["state"] = full_state(runner.trainer)
        torch.save(record, out / "saved.pt")
    finally:
        await runner.close()


def assert_same_job_state(saved: dict, resumed: dict, change: str) -> None:
    """The resumed job holds exactly what the saved one held: counters, buffer, data cursor, the
    model (fp32 masters) and every AdamW moment and step count. Resharding copies, it never rounds."""
    assert (resumed["step"], resumed["version"], resumed["steps_done"]) == (saved["step"], saved["version"], 2)
    assert saved["buffer"], "APRIL left nothing in the buffer: the test would prove nothing"
    assert resumed["buffer"] == saved["buffer"]
    assert resumed["cursor"] == saved["cursor"]
    model, optim = saved["state"]["model"], saved["state"]["optim"]
    assert resumed["state"]["model"].keys() == model.keys()
    for name, tensor in model.items():
        assert torch.equal(resumed["state"]["model"][name], tensor), f"{name} changed across the {change} resharding"
    assert resumed["state"]["optim"].keys() == optim.keys() and optim
    for name, moments in optim.items():
        assert float(moments["exp_avg"].abs().sum()) > 0, f"{name}: no AdamW moment was saved"
        for key, value in moments.items():
            got = resumed["state"]["optim"][name][key]
            assert torch.equal(got.to(value.dtype), value), \
                f"AdamW {key} of {name} changed across the {change} resharding ({got.flatten()[:4]} != {value.flatten()[:4]})"


def test_a_catch_up_sync_on_two_ranks_gives_the_engine_the_current_weights_again(tmp_path: Path) -> None:
    from tests.integration.test_runner_resume import job_doc, tiny_policy

    doc = job_doc(tiny_policy(tmp_path / "model"), tmp_path / "ckpt", steps=3, every=100)
    run_ranks(_run_rank, 2, doc, tmp_path, "catch-up")
    record = torch.load(tmp_path / "caught-up.pt", weights_only=False)
    assert (record["step"], record["version"]) == (1, 1)
    assert any(float(t.abs().sum()) > 0 for t in record["engine"].values())
    assert all(torch.equal(record["engine"][k], v) for k, v in record["state"]["model"].items()), \
        "the catch-up did not give the engine the trainer's current weights"


async def test_a_checkpoint_of_two_ranks_resumes_in_one_process(tmp_path: Path) -> None:
    from rljob.api import parse_rljob
    from rljob.runtime.runner import JobRunner, RunOptions
    from tests.integration.test_runner_resume import job_doc, tiny_policy

    doc = job_doc(tiny_policy(tmp_path / "model"), tmp_path / "ckpt", steps=3, every=2)
    use_shorter_is_better(doc)  # AdamW moments that are not zero: the state compared means something
    run_ranks(_run_rank, 2, doc, tmp_path, "save")
    saved = torch.load(tmp_path / "saved.pt", weights_only=False)
    leader = torch.load(tmp_path / "ckpt" / "step-00000002" / "state.pt", weights_only=False)
    assert leader["world_size"] == 2
    assert sorted(p.name for p in (tmp_path / "ckpt" / "step-00000002" / "rng").iterdir()) == [
        "rank-00000.pt", "rank-00001.pt"]
    # The engine held exactly the gathered full weights of step 2.
    assert all(torch.equal(saved["engine"][k], v) for k, v in saved["state"]["model"].items())

    runner = JobRunner(parse_rljob(doc), RunOptions(output_dir=tmp_path / "single"))
    await runner.setup()
    try:
        resumed = leader_record(runner)
        resumed["state"] = full_state(runner.trainer)
        assert_same_job_state(saved, resumed, "2 -> 1")
        record = await runner.run_step()  # and the single process trains on from there
        assert record.step == 3 and record.train.loss == record.train.loss
    finally:
        await runner.close()


def test_a_checkpoint_of_two_ranks_resumes_on_four(tmp_path: Path) -> None:
    from tests.integration.test_runner_resume import job_doc, tiny_policy

    doc = job_doc(tiny_policy(tmp_path / "model"), tmp_path / "ckpt", steps=3, every=2)
    use_shorter_is_better(doc)  # AdamW moments that are not zero: the state compared means something
    run_ranks(_run_rank, 2, doc, tmp_path, "save")
    run_ranks(_run_rank, 4, doc, tmp_path, "resume")  # 4 gloo ranks: each holds a quarter of every shard
    saved = torch.load(tmp_path / "saved.pt", weights_only=False)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)
    assert_same_job_state(saved, resumed, "2 -> 4")
    # The resume synced the engine: it serves the checkpoint's weights, gathered from 4 ranks.
    assert all(torch.equal(resumed["engine"][k], v) for k, v in saved["state"]["model"].items())
    step, loss = resumed["next"]
    assert step == 3 and loss == loss
    assert (tmp_path / "ckpt" / "step-00000003" / "state.pt").is_file()
    assert torch.load(tmp_path / "ckpt" / "step-00000003" / "state.pt", weights_only=False)["world_size"] == 4


async def test_a_bf16_checkpoint_of_one_process_resumes_on_two_ranks(tmp_path: Path) -> None:
    from tests.integration.test_runner_resume import job_doc, tiny_policy

    doc = job_doc(tiny_policy(tmp_path / "model"), tmp_path / "ckpt", steps=3, every=2)
    use_shorter_is_better(doc)  # AdamW moments that are not zero: the state compared means something
    doc["spec"]["trainer"]["dtype"] = "bfloat16"
    await _save_in_one_process(doc, tmp_path)
    run_ranks(_run_rank, 2, doc, tmp_path, "resume")
    saved = torch.load(tmp_path / "saved.pt", weights_only=False)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)
    # One process saved its fp32 masters (not the bf16 parameters, whose low bits are gone).
    assert all(t.dtype == torch.float32 for t in saved["state"]["model"].values())
    assert_same_job_state(saved, resumed, "1 -> 2 (bf16)")
    step, loss = resumed["next"]
    assert step == 3 and loss == loss


# ---------------------------------------------------------------------------------------------
# end to end: rljob run --nproc 2, rank 1 killed with SIGKILL mid-run, the group restarts and resumes


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of the child of `launcher` whose environment says RANK=`rank` (the elastic agent's worker)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    return None


def test_rljob_run_on_two_ranks_survives_a_kill_of_rank_1(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    import yaml

    from rljob.runtime.metrics import read_jsonl
    from tests.integration.test_runner_resume import job_doc, tiny_policy

    model = tiny_policy(tmp_path / "model")
    doc = job_doc(model, tmp_path / "ckpt", steps=5, every=1)
    doc["spec"]["algorithm"]["learningRate"] = 5e-3
    doc["spec"]["evaluation"] = {"everySteps": 5, "prompts": 4}
    # A signal to train on, and a held-out reward (measured with the same function) able to move.
    use_shorter_is_better(doc, tmp_path)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    log = tmp_path / "run.log"
    cmd = [sys.executable, "-m", "rljob.runtime.cli", "run", str(job), "--nproc", "2", "--max-restarts", "1",
           "--no-live", "--output", str(tmp_path / "out")]
    with log.open("w") as out:
        # No empty PYTHONPATH entry: it would put the working directory (the repo, whose operator/
        # shadows the stdlib's) on the path.
        path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
        scratch = tmp_path / "tmp"  # the launcher's temporary folders, to see that none is left
        scratch.mkdir()
        env = {**os.environ, "COLUMNS": "300", "PYTHONPATH": path, "TMPDIR": str(scratch)}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 600
            while not (tmp_path / "ckpt" / "step-00000002").is_dir():
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "no checkpoint of step 2 within 600 s\n" + log.read_text()
                time.sleep(0.5)
            rank1 = _rank_pid(proc.pid, 1)
            assert rank1 is not None, "rank 1 not found among the launcher's children"
            os.kill(rank1, signal.SIGKILL)
            assert proc.wait(timeout=900) == 0, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert "resumed from" in text, text  # the restarted group resumed instead of starting over
    # The agent's rank log folders went with the launch (torch's default left a torchelastic_* folder).
    assert not [p.name for p in scratch.iterdir() if p.name.startswith(("torchelastic_", "rljob-ranks-"))]
    resumed_at = int(text.split("resumed from", 1)[1].split("at step", 1)[1].split()[0])
    assert resumed_at >= 2
    assert (tmp_path / "ckpt" / "step-00000005" / "state.pt").is_file()
    records = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert records[-1]["step"] == 5 and records[-1]["policy_version"] == 5
    # After the resume the steps continue from the checkpoint: steps resumed_at+1..5, once each.
    assert [r["step"] for r in records if r["step"] > resumed_at][-(5 - resumed_at):] == list(range(resumed_at + 1, 6))
    losses = [r["loss"] for r in records]
    assert all(loss == loss for loss in losses) and len(set(losses)) > 1, losses
    # A step has no gradient only when every sample scored alike: the reward is the length, so every
    # sample of it had the same length (found under load: a step of only buffered samples, all finished
    # at the length cap). Every other step trained.
    assert all(r["grad_norm"] > 0 or r["length_std"] == 0 for r in records), [
        (r["step"], r["grad_norm"], r["length_std"]) for r in records]
    assert sum(r["grad_norm"] > 0 for r in records) >= 3, "nothing was trained"
    evals = read_jsonl(tmp_path / "out" / "eval.jsonl")
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 5
    print("held-out reward", [(e["step"], e["reward_mean"]) for e in evals], "losses", losses)
    # The weights moved away from the base model (the policy the held-out reward is measured on).
    from rljob.runtime.export import export_checkpoint
    from transformers import AutoModelForCausalLM

    export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    base = AutoModelForCausalLM.from_pretrained(model).state_dict()
    assert max(float((trained[k] - base[k]).abs().max()) for k in base) > 1e-4
