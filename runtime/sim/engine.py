"""A simulated inference engine: continuous batching under a KV-capacity limit, event-driven.

It implements the runtime's Engine interface, so the rollout scheduler talks to it exactly as to
SGLang. Between two events (a request finishing, the KV cache filling, an admission or an abort)
the running set is fixed and every step costs (perf_model.md §3.3)

    t_step = a + n·κ + kv·Σ ctx_i,   a = t0 + W/(k·BW),   kv = kvb/(k·BW),

which grows linearly with the step index because every context grows by one token a step. The
time of k steps is therefore a quadratic in k, so the engine jumps from event to event with one
timer instead of waking up every decode step. Admissions happen at step boundaries and pay a
prefill of their whole input (a resumed or retracted request re-prefills its prefix: no KV
survives an abort). When the KV cache overflows, the newest requests are retracted and queued
again. Aborts take effect at the first step boundary after the abort latency.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass

from rljob.runtime.engines.base import (
    Engine,
    EngineLoad,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    WeightUpdate,
)
from rljob.runtime.sim.length_model import LengthModel, decode_identity
from rljob.runtime.sim.scenario import EngineConstants

_EPS = 1e-12


@dataclass
class ResponseOracle:
    """Decides how long a simulated request runs; shared by all engines of a simulation.

    Units are quanta of `quantum` tokens. `draft_accept` > 0 models SPEC-RL draft reuse: a first
    segment of a prompt seen in an earlier epoch gets that share of its response accepted from
    the previous epoch's draft at verification (prefill) cost.
    """

    lengths: LengthModel
    quantum: int
    prompt_units: int
    draft_accept: float = 0.0

    @property
    def cap_units(self) -> int:
        return math.ceil(self.lengths.cap / self.quantum)

    def plan(self, request: GenerateRequest, version: int) -> tuple[int, FinishReason, int]:
        """(units this call generates, finish reason when it gets there, draft units accepted)."""
        uid, epoch = decode_identity(request.input_ids)
        already = len(request.input_ids) - self.prompt_units
        total_tokens = self.lengths.draw_total(uid, already * self.quantum, version)
        total = min(self.cap_units, math.ceil(total_tokens / self.quantum))
        remaining = max(1, total - already)
        finish: FinishReason
        if remaining <= request.max_new_tokens:
            target, finish = remaining, ("length" if total >= self.cap_units else "stop")
        else:
            target, finish = request.max_new_tokens, "length"
        bonus = 0
        if self.draft_accept > 0 and epoch > 0 and already == 0 and target > 1:
            bonus = min(target - 1, int(self.draft_accept * target))
        return target, finish, bonus


@dataclass(eq=False)
class _Seq:
    rid: str
    future: asyncio.Future[GenerateResult]
    context: int  # units in KV at admission: input + tokens this call made before a retraction
    target: int  # units this call produces before finishing with `finish`
    finish: FinishReason
    version: int
    prompt_tokens: int
    done: int = 0  # units this call produced before the current admission (incl. draft units)
    start_step: int = -1
    order: int = 0

    def produced(self, step: int) -> int:
        return self.done + (step - self.start_step)


@dataclass
class EngineCounters:
    """What an engine did, for the simulator's report (units of the oracle's quantum)."""

    busy_seconds: float = 0.0  # some request running or prefilling
    decode_units: int = 0
    prefill_units: int = 0
    draft_units: int = 0
    retractions: int = 0
    aborted_requests: int = 0


class SimEngine(Engine):
    """One simulated engine (a TP group)."""

    def __init__(self, name: str, constants: EngineConstants, oracle: ResponseOracle, ceiling: float | None = None):
        self.name = name
        self.c = constants
        self.oracle = oracle
        self.quantum = oracle.quantum
        self.capacity = max(1, constants.kv_capacity_tokens // self.quantum)  # units
        self.version = 0
        self.counters = EngineCounters()
        self._ceiling = ceiling
        self._running: dict[str, _Seq] = {}
        self._waiting: deque[_Seq] = deque()
        self._heap: list[tuple[int, int, _Seq]] = []
        self._order = itertools.count()
        self._step = 0
        self._t_ref = 0.0  # virtual time of step boundary `_step`
        self._ctx = 0  # Σ context units of running requests at `_step`
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = math.inf
        self._abort_prefixes: list[str] = []
        self._abort_at = math.inf
        self._paused_until = 0.0

    # ------------------------------------------------------------------ cost model

    def _coefficients(self) -> tuple[float, float]:
        """(b0, b1): the k-th step from `_step` (0-based) costs b0 + b1·k seconds."""
        q, n, c = self.quantum, len(self._running), self.c
        kv = c.kv_read_s_per_token
        b0 = q * (c.fixed_step_s + n * c.per_seq_step_s) + kv * (q * q * self._ctx + n * q * (q - 1) / 2)
        return b0, kv * q * q * n

    def step_seconds(self, k: int) -> float:
        """Time of the next k (quantum) steps with the current running set."""
        b0, b1 = self._coefficients()
        return k * b0 + b1 * k * (k - 1) / 2

    def _steps_until(self, t: float) -> int:
        """Smallest k with `_t_ref + step_seconds(k) >= t` (a boundary at or after t)."""
        dt = t - self._t_ref
        if dt <= _EPS or not self._running:
            return 0
        b0, b1 = self._coefficients()
        if b1 <= 0:
            k = math.ceil(dt / b0 - 1e-9)
        else:
            a, b = b1 / 2, b0 - b1 / 2
            k = math.ceil((-b + math.sqrt(b * b + 4 * a * dt)) / (2 * a) - 1e-9)
        while k > 0 and self.step_seconds(k - 1) >= dt - _EPS:
            k -= 1
        while self.step_seconds(k) < dt - _EPS:
            k += 1
        return k

    def _advance(self, step: int) -> None:
        k = step - self._step
        if k <= 0:
            return
        dt = self.step_seconds(k)
        self._t_ref += dt
        self.counters.busy_seconds += dt
        self.counters.decode_units += k * len(self._running)
        self._ctx += k * len(self._running)
        self._step = step

    # ------------------------------------------------------------------ event handling

    def _loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    def _time_of(self, step: int) -> float:
        return self._t_ref + self.step_seconds(step - self._step)

    def _boundary_at_or_after(self, t: float) -> tuple[int, float]:
        if not self._running:  # idle: nothing advances, a boundary is just a moment
            return self._step, max(t, self._t_ref)
        step = self._step + self._steps_until(t)
        return step, self._time_of(step)

    def _valid(self, entry: tuple[int, int, _Seq]) -> bool:
        seq = entry[2]
        return self._running.get(seq.rid) is seq and seq.order == entry[1]

    def _replan(self) -> None:
        """Arm the one timer at the next step boundary where something happens."""
        now = self._loop().time()
        if not self._running:
            self._t_ref = max(self._t_ref, now)
            self._abort_prefixes, self._abort_at = [], math.inf
        events: list[tuple[float, int]] = []
        while self._heap and not self._valid(self._heap[0]):
            heapq.heappop(self._heap)
        if self._heap:
            events.append((self._time_of(self._heap[0][0]), self._heap[0][0]))
        n = len(self._running)
        if n > 1:  # the first step whose contexts no longer fit: retract then
            step = self._step + max(1, (self.capacity - self._ctx) // n + 1)
            events.append((self._time_of(step), step))
        if self._abort_prefixes:
            events.append(self._boundary_at_or_after(self._abort_at)[::-1])
        if self._waiting and n < self.c.max_running_requests:
            head = self._waiting[0].context
            if not n or self._ctx + head <= self.c.admit_fraction * self.capacity:
                events.append(self._boundary_at_or_after(max(now, self._paused_until))[::-1])
        self._cancel_timer()
        if events:
            when, step = min(events)
            self._timer_when = max(when, now)
            self._timer = self._loop().call_at(self._timer_when, self._on_timer, step)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._timer_when = math.inf

    def _on_timer(self, step: int) -> None:
        self._timer = None
        self._timer_when = math.inf
        now = self._loop().time()
        self._advance(step)
        if not self._running:
            self._t_ref = max(self._t_ref, now)
        self._finish_due()
        if self._abort_prefixes and now >= self._abort_at - 1e-9:
            self._abort_running()
        self._retract_if_full()
        if now >= self._paused_until - 1e-9:
            self._admit()
        self._replan()

    def _resolve(self, seq: _Seq, units: int, reason: FinishReason) -> None:
        if not seq.future.done():
            seq.future.set_result(GenerateResult(
                rid=seq.rid, output_ids=[0] * units, output_logprobs=[0.0] * units, finish_reason=reason,
                weight_version=seq.version, prompt_tokens=seq.prompt_tokens,
            ))

    def _finish_due(self) -> None:
        while self._heap and self._heap[0][0] <= self._step:
            entry = heapq.heappop(self._heap)
            seq = entry[2]
            if self._valid(entry):
                del self._running[seq.rid]
                self._ctx -= seq.context + (self._step - seq.start_step)
                self._resolve(seq, seq.target, seq.finish)

    def _abort_running(self) -> None:
        prefixes, self._abort_prefixes, self._abort_at = self._abort_prefixes, [], math.inf
        for rid, seq in list(self._running.items()):
            if any(rid.startswith(p) for p in prefixes):
                del self._running[rid]
                self._ctx -= seq.context + (self._step - seq.start_step)
                self.counters.aborted_requests += 1
                self._resolve(seq, seq.produced(self._step), "abort")

    def _retract_if_full(self) -> None:
        if self._ctx <= self.capacity:
            return
        newest_first = sorted(self._running.values(), key=lambda s: s.order, reverse=True)
        for seq in newest_first:
            if self._ctx <= self.c.admit_fraction * self.capacity or len(self._running) == 1:
                break
            del self._running[seq.rid]
            grown = self._step - seq.start_step
            self._ctx -= seq.context + grown
            seq.done += grown
            seq.context += grown  # re-prefilled on readmission: its KV is gone
            self.counters.retractions += 1
            self._waiting.appendleft(seq)

    def _admit(self) -> None:
        prefill = 0
        while self._waiting and len(self._running) < self.c.max_running_requests:
            seq = self._waiting[0]
            if self._running and self._ctx + seq.context > self.c.admit_fraction * self.capacity:
                break
            self._waiting.popleft()
            seq.start_step = self._step
            seq.order = next(self._order)
            self._running[seq.rid] = seq
            self._ctx += seq.context
            prefill += seq.context
            heapq.heappush(self._heap, (self._step + seq.target - seq.done, seq.order, seq))
        if prefill:
            dt = prefill * self.quantum * self.c.prefill_s_per_token
            self._t_ref += dt
            self.counters.busy_seconds += dt
            self.counters.prefill_units += prefill

    # ------------------------------------------------------------------ Engine interface

    async def start(self) -> None:
        return None

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        target, finish, bonus = self.oracle.plan(request, self.version)
        seq = _Seq(
            rid=request.rid, future=self._loop().create_future(), context=len(request.input_ids) + bonus,
            target=target, finish=finish, version=self.version,
            prompt_tokens=len(request.input_ids) * self.quantum, done=bonus,
        )
        self.counters.draft_units += bonus
        self._waiting.append(seq)
        self._replan()
        return await seq.future

    async def abort(self, rid_prefix: str) -> None:
        kept: deque[_Seq] = deque()
        for seq in self._waiting:  # queued requests end at once, with what they had made
            if seq.rid.startswith(rid_prefix):
                self.counters.aborted_requests += 1
                self._resolve(seq, seq.done, "abort")
            else:
                kept.append(seq)
        self._waiting = kept
        if any(rid.startswith(rid_prefix) for rid in self._running):
            self._abort_prefixes.append(rid_prefix)
            self._abort_at = min(self._abort_at, self._loop().time() + self.c.abort_latency_s)
        self._replan()

    async def abort_all(self) -> None:
        await self.abort("")

    async def load(self) -> EngineLoad:
        return EngineLoad(running=len(self._running), waiting=len(self._waiting))

    async def update_weights(self, update: WeightUpdate) -> None:
        """Interrupt whatever runs (AReaL-style), then pause for the weight-sync latency."""
        if self._running or self._waiting:
            await self.abort_all()
        self.version = update.version
        self._paused_until = self._loop().time() + self.c.weight_sync_s
        await asyncio.sleep(self.c.weight_sync_s)
        self._replan()

    async def health(self) -> bool:
        return True

    def ceiling_tokens_per_s(self) -> float | None:
        return self._ceiling
