"""The runtime's async strategy in the simulator: overlap with training, interruption by the weight sync,
resumption under the new weights, the staleness bound, and the token ledger, checked on the records of
small virtual-time runs (deterministic for a seed)."""

from __future__ import annotations

import pydantic
import pytest

from rljob.runtime.sim.records import SimStrategyResult
from rljob.runtime.sim.runner import simulate_strategy
from rljob.runtime.sim.scenario import AsyncSpec, Scenario, StrategySpec, SyncSpec
from tests.helpers.sim_scenarios import small_scenario


def scenario(**update: object) -> Scenario:
    """The small scenario with N fixed at 4 groups, whatever the split gives the rollout."""
    return small_scenario(**{"rollout_batch_size": 4, **update})


def run(spec: StrategySpec, **update: object) -> SimStrategyResult:
    return simulate_strategy(scenario(**update), spec)


ASYNC = AsyncSpec(kind="async", trainer_gpu_share=0.5)


def test_async_generates_while_the_trainer_trains_and_resumes_interrupted_responses_under_new_weights():
    result = run(ASYNC)
    assert result.rollout_gpus == 2  # the trainer has the other half to itself
    assert all(r.overlap_tokens > 0 for r in result.records)  # the engines never wait for the trainer
    assert all(r.overlap_tokens <= r.tokens_generated for r in result.records)
    # The weight sync interrupted responses; the next rounds resumed them under the new weights, so trained
    # responses carry tokens of two or more versions, each stamped with its own.
    assert sum(r.multi_version_samples for r in result.records) > 0
    assert 0.0 < result.off_policy_share < 1.0
    sync = run(SyncSpec(kind="sync"), colocated=False)
    assert all(r.overlap_tokens == 0 for r in sync.records)


@pytest.mark.parametrize("dynamic_sampling", [False, True])
@pytest.mark.parametrize("eta", [0, 1, 2])
def test_async_conserves_tokens_every_step(eta: int, dynamic_sampling: bool):
    """Round ledger: what the buffer held + what was generated = trained + thrown away (filtered,
    regenerated) + what the buffer holds after the step; nothing is lost or counted twice."""
    result = run(ASYNC, max_staleness=eta, dynamic_sampling=dynamic_sampling, steps=8)
    before = 0
    for r in result.records:
        assert before + r.tokens_generated == r.trained_tokens + r.wasted_tokens + r.buffer_tokens, r.step
        before = r.buffer_tokens
    if dynamic_sampling:
        assert sum(r.dropped_groups for r in result.records) > 0  # the filter ran, its tokens are in `wasted`


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_async_never_trains_a_sample_over_the_staleness_bound(eta: int):
    result = run(ASYNC, max_staleness=eta, steps=8)
    assert max(r.max_staleness for r in result.records) <= eta
    assert all(r.trained_groups == 4 for r in result.records)


def test_async_with_eta_zero_regenerates_what_it_generated_ahead_and_trains_on_policy():
    result = run(ASYNC, max_staleness=0, steps=8)
    assert result.off_policy_share == 0.0
    # Everything generated during training was stamped with the old version: over the bound once the
    # weights changed, so it is regenerated (counted as wasted), never trained.
    assert sum(r.wasted_tokens for r in result.records[1:]) > 0


def test_async_beats_sync_on_the_same_split_when_training_takes_time():
    """Disaggregated, sync leaves the engines idle while the trainer trains; async fills that time."""
    slow_trainer = dict(colocated=False, gpus=8, trainer_gpu_share=0.75, tensor_parallel=2, max_response_length=4096)
    sync = run(SyncSpec(kind="sync"), **slow_trainer)
    asynchronous = run(AsyncSpec(kind="async"), **slow_trainer)
    assert sync.rollout_gpus == asynchronous.rollout_gpus == 2
    assert asynchronous.step_seconds < sync.step_seconds
    assert all(r.trained_groups == 4 for r in sync.records + asynchronous.records)  # same batch: same work


def test_async_in_a_colocated_scenario_needs_a_trainer_share():
    with pytest.raises(pydantic.ValidationError, match="trainer_gpu_share"):
        scenario(strategies=[{"kind": "async"}])
    assert scenario(strategies=[{"kind": "async", "trainer_gpu_share": 0.25}]).strategies[0].kind == "async"
    assert scenario(colocated=False, strategies=[{"kind": "async"}]).strategies[0].kind == "async"


def test_measured_trainer_time_is_spread_over_the_trainer_gpus_of_each_strategy():
    """A published or measured trainer time (GPU-seconds per step) replaces the FLOP model; the async arm
    may carry its own (a disaggregated trainer need not be as efficient as a colocated one)."""
    sync = run(SyncSpec(kind="sync"), train_gpu_seconds_per_step=100.0)
    assert all(r.train_s == pytest.approx(25.0) for r in sync.records)  # colocated: all 4 GPUs train
    own = run(AsyncSpec(kind="async", trainer_gpu_share=0.5, train_gpu_seconds_per_step=60.0),
              train_gpu_seconds_per_step=100.0)
    assert all(r.train_s == pytest.approx(30.0) for r in own.records)  # its own, on its 2 trainer GPUs
    shared = run(ASYNC, train_gpu_seconds_per_step=100.0)
    assert all(r.train_s == pytest.approx(50.0) for r in shared.records)


def test_a_fitted_median_replaces_the_datasets():
    short, long = (run(SyncSpec(kind="sync"), median_tokens=m) for m in (1000.0, 4000.0))
    per_sample = [sum(r.trained_tokens for r in res.records) / sum(r.trained_groups * 4 for r in res.records)
                  for res in (short, long)]
    assert per_sample[1] > 2.5 * per_sample[0]
