"""The step record: nested parts built from what each stage measured, flat only on export."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from rljob.runtime.batch_stats import summarize_batch
from rljob.runtime.rollout.sample import Group, Sample
from rljob.runtime.rollout.scheduler import RoundResult, RoundStats
from rljob.runtime.step_record import BatchPart, RoundPart, StepRecord, SyncPart, TrainPart, step_record
from rljob.runtime.weights.transport import SyncReport

# metrics.jsonl's keys before the record was split into parts: the alerts, the dashboard, the report and
# the autotuner read them, so the split must not change one. (Three ledger keys were renamed since, one word
# per outcome: metrics.LEGACY_KEYS reads older runs.)
EXPORTED_KEYS = {
    "step", "policy_version", "strategy", "time", "step_seconds", "rollout_seconds", "train_seconds",
    "sync_seconds", "tokens_generated", "rollout_tokens_per_s", "ceiling_tokens_per_s", "truncation_rate",
    "cap_hit_rate", "launched_samples", "partial_samples", "resumed_samples", "regenerated_samples",
    "resumed_prefix_tokens", "off_policy_token_ratio", "fork_off_policy_ratio", "staleness_max", "staleness_mean",
    "buffer_groups", "surplus_groups", "filtered_groups", "filtered_tokens", "abort_drain_seconds", "engine_errors",
    "weight_sync_failures", "engines_in_rotation", "new_groups", "buffer_groups_before", "trained_groups",
    "buffered_groups", "discarded_groups", "regenerated_tokens", "discarded_tokens", "trained_tokens",
    "buffer_tokens_before", "buffer_tokens_after", "length_mean", "length_std", "length_p50", "length_p99",
    "length_max", "reward_mean", "eval_reward", "entropy", "kl", "clip_fraction", "loss", "grad_norm", "knobs",
    "staleness", "lengths",
    "data_rows_skipped",  # added after the split (bad data rows skipped, by reason)
    # issue 25: signals with one meaning each (docs/metrics.md)
    "partial_rate", "aborted_tokens", "aborted_token_share", "goodput_tokens_per_s", "trainer_idle_seconds",
    "engine_idle_seconds", "wall_seconds", "end_to_end_seconds",
    "sync_bytes",  # the weight sync's bytes (with sync_seconds: its bandwidth)
    "overlap_seconds", "overlap_tokens",  # async: generation while the trainer trained
}


def test_parts_share_no_field_name_so_flattening_loses_nothing():
    names = [f.name for part in (RoundPart, BatchPart, TrainPart, SyncPart) for f in fields(part)]
    top = [f.name for f in fields(StepRecord)]
    assert len(names) == len(set(names))
    assert not set(names) & set(top)


def test_the_exported_keys_are_those_of_the_flat_record_before_the_split():
    rec = StepRecord(step=1, policy_version=1, strategy="april", time=0.0)
    assert set(rec.flat()) == EXPORTED_KEYS
    assert set(json.loads(rec.to_json())) == EXPORTED_KEYS


class _Metrics:  # what Trainer.train_step returns, as far as the record reads it
    entropy = 1.5
    kl = 0.25
    clip_frac = 0.125
    loss = -0.5
    grad_norm = None  # not measured: exported as 0


def _group(rewards: list[float], versions: list[int]) -> Group:
    samples = []
    for i, (reward, version) in enumerate(zip(rewards, versions, strict=True)):
        s = Sample("g", i, prompt_ids=[1, 2], answer="")
        s.append([5, 6, 7], [-0.1, -0.2, -0.3], version)
        s.reward = reward
        samples.append(s)
    return Group("g", "prompt", samples)


def test_a_step_record_takes_each_stage_as_it_measured_it():
    stats = RoundStats(round_index=3, policy_version=2, strategy="april", rollout_seconds=2.0,
                       tokens_generated=400, launched_samples=8, cap_hit_samples=2, buffer_groups_after=5,
                       new_groups=4, filtered_groups=1, filtered_tokens=30, trained_tokens=6)
    groups = [_group([1.0, 0.0], [1, 2])]
    sync = SyncReport(version=3, mode="tensor", updated=["e0", "e1"], failed={"e2": "timeout"}, bytes_sent=4096)
    timings = {"rollout": 2.5, "train": 1.0, "sync": 0.5}
    rec = step_record(3, 2, RoundResult(groups, stats), _Metrics(), timings, {"over_sampling": 2.0}, 900.0, sync)

    flat = rec.flat()
    assert (flat["step"], flat["policy_version"], flat["strategy"]) == (3, 3, "april")
    # Renamed or computed on the way: rate per rollout second (the round's own clock), cap-hit share.
    assert flat["rollout_tokens_per_s"] == 200.0 and flat["cap_hit_rate"] == 0.25
    assert flat["buffer_groups"] == 5 and flat["ceiling_tokens_per_s"] == 900.0
    assert (flat["new_groups"], flat["filtered_groups"], flat["filtered_tokens"]) == (4, 1, 30)
    assert flat["step_seconds"] == 4.0 and flat["rollout_seconds"] == 2.5
    assert (flat["entropy"], flat["kl"], flat["clip_fraction"], flat["grad_norm"]) == (1.5, 0.25, 0.125, 0.0)
    assert (flat["engines_in_rotation"], flat["weight_sync_failures"], flat["sync_bytes"]) == (2, 1, 4096)
    batch = summarize_batch(groups, 2)
    assert flat["reward_mean"] == batch.reward_mean == 0.5
    assert flat["staleness"] == batch.staleness and flat["off_policy_token_ratio"] == batch.off_policy_token_ratio
    assert flat["knobs"] == {"over_sampling": 2.0} and flat["eval_reward"] is None


def test_a_step_without_training_metrics_or_sync_exports_zeros():
    stats = RoundStats(round_index=1, policy_version=0, strategy="sync")
    rec = step_record(1, 0, RoundResult([], stats), None, {"rollout": 1.0}, {}, 0.0, None)
    assert rec.train == TrainPart() and rec.sync == SyncPart()
    assert rec.step_seconds == 1.0 and rec.round.cap_hit_rate == 0.0


def test_goodput_waste_and_idle_signals_of_a_step():
    """Goodput is trained tokens per end-to-end second; waste is what was generated and thrown away;
    the trainer waits for the round, the engines for the train step."""
    stats = RoundStats(round_index=1, policy_version=0, strategy="april", tokens_generated=1000,
                       launched_samples=10, trained_tokens=600, regenerated_tokens=50, filtered_tokens=100,
                       discarded_tokens=50, cut_keys={("g1", 0), ("g1", 1)},
                       unfinished_keys={("g1", 1), ("g2", 0), ("g2", 1)})
    timings = {"rollout": 3.0, "train": 1.5, "sync": 0.5, "wall": 6.0}  # 1 s of evaluation/checkpoint
    rec = step_record(1, 0, RoundResult([], stats), None, timings, {}, 0.0, None)
    flat = rec.flat()
    assert flat["truncation_rate"] == 0.2 and flat["partial_rate"] == 0.2  # g1/1 was cut, then ran at stop
    assert flat["aborted_tokens"] == 200 and flat["aborted_token_share"] == 0.2
    assert flat["goodput_tokens_per_s"] == 100.0  # 600 tokens over 6 s of wall, not the 5 s of phases
    assert flat["trainer_idle_seconds"] == 4.0 and flat["engine_idle_seconds"] == 2.5
    unmeasured = step_record(1, 0, RoundResult([], stats), None, {"rollout": 3.0, "train": 1.0}, {}, 0.0, None)
    assert unmeasured.goodput_tokens_per_s == 150.0 and unmeasured.engine_idle_seconds == 1.0


def test_under_async_the_engines_generating_through_the_train_step_are_not_idle():
    """The async strategy's engines generate while the trainer trains (until the sync interrupts
    them): that overlap is exported and is not engine idle; the trainer still waits for the round."""
    stats = RoundStats(round_index=1, policy_version=0, strategy="async", tokens_generated=1000,
                       overlap_seconds=1.4, overlap_tokens=300)
    timings = {"rollout": 3.0, "train": 1.5, "sync": 0.5, "wall": 6.0}  # 1 s of evaluation/checkpoint
    rec = step_record(1, 0, RoundResult([], stats), None, timings, {}, 0.0, None)
    flat = rec.flat()
    assert flat["overlap_seconds"] == 1.4 and flat["overlap_tokens"] == 300
    assert flat["engine_idle_seconds"] == pytest.approx(1.1)  # 6 - 3 - 1.4 - 0.5: the evaluation, a bubble
    assert flat["trainer_idle_seconds"] == 4.0
