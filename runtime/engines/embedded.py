"""In-process PyTorch continuous-batching engine over Hugging Face causal-LM classes.

One background asyncio task runs the decode loop. Each iteration (one "step") frees the KV slots of
finished sequences, prefills the requests admitted from the waiting queue (a few forwards over prompts
of similar length, each distinct prompt at most once: requests with the same token ids, a GRPO group's
samples, share one prefill through the prefix cache, prefix_cache.py) into free slots of the
preallocated KV cache (slot_cache.py), and decodes one token for every running sequence in one forward.
With ``chunked_prefill_tokens`` the prompts ride in the decode forward instead, at most that many
tokens a step (chunked_prefill.py). The torch work of a step runs
in a worker thread (``asyncio.to_thread``), so the event loop stays free to accept requests and aborts
while a step computes; weight updates take the same lock as a step, so they land between steps.

Abort follows SGLang: a waiting request finishes at once with no tokens; a running one finishes after
the step in flight, with every token generated so far (log-probs included). Log-probs follow the
convention of ``sampling.py``: log_softmax(logits / temperature) of the chosen token, before top-k/top-p.
With a prefix cache, an aborted row's keys and values are kept, as SGLang's radix cache keeps an aborted
request's: the sample resumed from it (its ids + the tokens it got) decodes on with no prefill. A
weight install drops them unless told to keep the cache (``flush_cache`` False,
docs/weight_sync.md#keeping-the-cache).

Why one module of about 870 lines: the decode loop, admission, aborts, the weight install and both
kinds of step (prefill then decode, or chunks mixed into the decode) share one lock and one table of
running sequences; the KV cache (slot_cache.py), the prefix cache (prefix_cache.py), the mixed forward
and its chunk plan (chunked_prefill.py), sampling (sampling.py) and the HTTP face (server.py) already
live apart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from transformers import DynamicCache, PreTrainedModel

from rljob.runtime.engines.base import (
    Engine,
    EngineError,
    EngineLoad,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    InvalidRequestError,
    WeightUpdate,
)
from rljob.runtime.engines.chunked_prefill import (
    MixedBatch,
    PartialPrefill,
    Piece,
    enable_mixed_attention,
    plan_pieces,
)
from rljob.runtime.engines.prefix_cache import Interrupted, Prefill, PrefillCache
from rljob.runtime.engines.sampling import SamplingParams, sample_tokens
from rljob.runtime.engines.slot_cache import SlotKVCache

log = logging.getLogger(__name__)
T = TypeVar("T")
Detokenize = Callable[[list[int]], str]
_GroupKey = tuple[int, ...] | int  # what sequences sharing one prefill have in common (_group_key)
# Default prefix cache: 16384 prompt tokens of keys and values (as much as 64 rows of 256-token prompts).
DEFAULT_PREFIX_CACHE_TOKENS = 16384


@dataclass
class EngineStats:
    """Counters since start; the runtime metrics and the benchmark read them."""

    generated_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens run through the model
    cached_prefill_tokens: int = 0  # prompt tokens taken from a shared prefill instead (prefix_cache.py)
    resumed_without_prefill: int = 0  # requests that took an interrupted row's keys and values
    prefill_steps: int = 0  # forwards that ran prompt tokens (with chunked prefill: steps carrying a chunk)
    mixed_steps: int = 0  # of those, forwards that also decoded running sequences (chunked prefill only)
    decode_steps: int = 0
    busy_seconds: float = 0.0  # wall time spent inside steps
    finished: Counter[str] = field(default_factory=Counter)  # finish reason -> requests
    last_step_tokens_per_s: float = 0.0  # generated tokens / wall time of the latest step
    full_step_seconds: float = 0.0  # moving average of decode-only steps at >= half the max batch

    @property
    def cache_hit_rate(self) -> float:
        """Share of admitted prompt tokens served from a shared prefill (SGLang's ``cache_hit_rate``)."""
        total = self.prefill_tokens + self.cached_prefill_tokens
        return self.cached_prefill_tokens / total if total else 0.0

    @property
    def tokens_per_busy_second(self) -> float:
        """Generated tokens per second of step time (0 before the first step)."""
        return self.generated_tokens / self.busy_seconds if self.busy_seconds > 0 else 0.0


@dataclass
class _Sequence:
    request: GenerateRequest
    future: asyncio.Future[GenerateResult]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    abort_requested: bool = False
    finish_reason: FinishReason | None = None
    slot: int | None = None  # its row in the KV cache once prefilled
    cached_tokens: int = 0  # prompt tokens it took from a shared prefill

    @property
    def sampling(self) -> SamplingParams:
        r = self.request
        return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)

    def take(self, token: int, logprob: float, detokenize: Detokenize | None = None) -> None:
        """Record one generated token and decide whether the sequence finished."""
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        if token in self.request.stop_token_ids or (detokenize is not None and self._hit_stop_string(detokenize)):
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.request.max_new_tokens:
            self.finish_reason = "length"

    def _hit_stop_string(self, detokenize: Detokenize) -> bool:
        """Whether the response text now contains a stop string (SGLang keeps it in the output).

        Checked after every token, so a match always ends in the newest token and a tail of text one
        character longer than the longest stop string suffices. Tokens may decode to nothing (special
        tokens) or to part of a character, so the tail grows until it is long enough.
        """
        stops = self.request.stop
        if not stops:
            return False
        need = max(map(len, stops))
        window = need + 1
        while True:
            tail = detokenize(self.output_ids[-window:])
            if len(tail) > need or window >= len(self.output_ids):
                return any(s in tail for s in stops)
            window *= 2


def prefill_chunks(items: list[T], length: Callable[[T], int], max_padding: float = 0.25) -> list[list[T]]:
    """Split a prefill into forwards of similar lengths: shortest first, each chunk's padded size
    (rows x longest) at most ``1 + max_padding`` times its real tokens.

    One left-padded forward over everything would pad a 5-token prompt to the width of a resumed
    200-token sample; real engines prefill ragged batches without padding at all.
    """
    chunks: list[list[T]] = []
    real = 0
    for item in sorted(items, key=length):
        n = length(item)
        if chunks and (len(chunks[-1]) + 1) * n <= (1 + max_padding) * (real + n):
            chunks[-1].append(item)
            real += n
        else:
            chunks.append([item])
            real = n
    return chunks


def _load_model(source: PreTrainedModel | str | Path, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    if isinstance(source, PreTrainedModel):
        return source.to(device=device).eval()  # type: ignore[call-arg]  # transformers' decorated .to: mypy mis-binds it
    # The trainer's loader: same architecture checks, same attention implementation.
    from rljob.runtime.models.loading import load_causal_lm
    from rljob.runtime.models.source import ModelSourceError

    try:
        return load_causal_lm(source, field="model directory", dtype=dtype, device=device)
    except ModelSourceError as exc:
        raise EngineError(str(exc)) from None


class EmbeddedEngine(Engine):
    """Continuous-batching engine running a Hugging Face causal LM in this process.

    ``model`` is an in-memory ``PreTrainedModel`` (used as is, not copied) or a ``save_pretrained``
    directory. ``max_batch_size`` bounds the running batch; further requests wait in FIFO order.
    ``seed`` seeds the sampling generator. ``torch_threads`` sets torch's intra-op threads when given.
    ``prefix_cache_tokens`` bounds the prefix cache (prefix_cache.py) that lets requests with the same
    token ids share one prefill; 0 turns sharing off (every request prefills its own prompt).
    ``chunked_prefill_tokens`` N > 0 mixes prefill into decode steps (chunked_prefill.py): each step's one
    forward carries every decode row and at most N prompt tokens, a longer prompt going on over the next
    steps; 0 (the default) prefills each admitted prompt whole, in forwards of its own before the step's decode.
    """

    name = "embedded"

    def __init__(
        self,
        model: PreTrainedModel | str | Path,
        *,
        max_batch_size: int = 32,
        seed: int = 0,
        weight_version: int = 0,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        torch_threads: int | None = None,
        max_context_len: int | None = None,
        detokenize: Detokenize | None = None,
        prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
        chunked_prefill_tokens: int = 0,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0 (0 turns prefix sharing off), got {prefix_cache_tokens}")
        if chunked_prefill_tokens < 0:
            raise ValueError(
                f"chunked_prefill_tokens must be >= 0 (0 turns chunked prefill off), got {chunked_prefill_tokens}"
            )
        self._source = model
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self.stats = EngineStats()
        self._device = torch.device(device)
        self._dtype = dtype
        self._seed = seed
        self._torch_threads = torch_threads
        self._max_context_len = max_context_len
        self._detokenize = detokenize  # needed for stop strings only
        self._model: PreTrainedModel | None = None
        # Every parameter and persistent buffer by state-dict name, built at the first load: loads replace
        # a parameter's data or copy into it, never the object, so the map stays right; building it per
        # bucket (state_dict walks every module) cost as much as installing a bucket.
        self._targets: dict[str, torch.Tensor] | None = None
        self._generator: torch.Generator | None = None
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._cache: SlotKVCache | None = None  # allocated on the first prefill
        self._prefixes: PrefillCache[Prefill] | None = PrefillCache(prefix_cache_tokens) if prefix_cache_tokens else None
        # Rows of sequences aborted part-way, for the samples that resume them (same budget, own entries).
        self._interrupted: PrefillCache[Interrupted] | None = (
            PrefillCache(prefix_cache_tokens) if prefix_cache_tokens else None)
        self.chunked_prefill_tokens = chunked_prefill_tokens
        self._partials: dict[_GroupKey, PartialPrefill] = {}  # prompts part-way through a chunked prefill
        self._wake = asyncio.Event()
        self._step_lock = asyncio.Lock()
        self._paused = False
        self._loop_task: asyncio.Task[None] | None = None

    # ----------------------------------------------------------------- lifecycle

    @property
    def model(self) -> PreTrainedModel:
        """The served model (raises before start())."""
        if self._model is None:
            raise EngineError("embedded engine not started: call `await engine.start()` first")
        return self._model

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the engine serves its weights in."""
        return self._dtype

    @property
    def max_context_len(self) -> int:
        """Longest prompt + generation the engine accepts."""
        if self._max_context_len is not None:
            return self._max_context_len
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    async def start(self) -> None:
        """Load the model (in a thread) and start the decode loop; idempotent."""
        if self._loop_task is not None:
            return
        if self._torch_threads:
            torch.set_num_threads(self._torch_threads)
        model = await asyncio.to_thread(_load_model, self._source, self._device, self._dtype)
        if self.chunked_prefill_tokens:
            try:
                enable_mixed_attention(model)
            except ValueError as exc:
                raise EngineError(f"embedded engine: {exc} (or set chunked_prefill_tokens 0)") from None
        self._model = model
        self._generator = torch.Generator(device=self._device).manual_seed(self._seed)
        self._loop_task = asyncio.create_task(self._decode_loop(), name="embedded-engine-decode-loop")

    async def close(self) -> None:
        """Abort everything (callers get their partial outputs) and stop the decode loop."""
        if self._loop_task is None:
            return
        await self.abort_all()
        task, self._loop_task = self._loop_task, None
        # Holding the step lock means no step is in its worker thread while we tear the batch down.
        async with self._step_lock:
            task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        # Sequences aborted while running finish only at the loop's next iteration, which will not come.
        for seq in self._running:
            self._finish(seq, seq.finish_reason or "abort")
        self._running, self._cache = [], None
        self._partials.clear()
        self.flush_prefix_cache()

    @property
    def shares_prefill(self) -> bool:
        """Whether requests with the same token ids share one prefill (a prefix cache is on)."""
        return self._prefixes is not None

    def flush_prefix_cache(self) -> None:
        """Forget every cached prefill and interrupted row (SGLang's ``/flush_cache``; weight installs do
        it themselves unless told to keep the cache)."""
        for cache in (self._prefixes, self._interrupted):
            if cache is not None:
                cache.clear()

    # ----------------------------------------------------------------- requests

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Queue ``request`` and wait for it to finish (stop, length or abort).

        With a prefix cache, ``max_new_tokens`` 0 is a prefill-only request, as in SGLang: it prefills the
        prompt into the cache (what SGLang's ``n`` does before sending the samples) and returns no tokens.
        """
        if self._loop_task is None:
            await self.start()
        self._validate(request)
        if request.max_new_tokens < 0 or (request.max_new_tokens == 0 and self._prefixes is None):
            return self._result_of(request, [], [], "length")
        seq = _Sequence(request=request, future=asyncio.get_running_loop().create_future())
        self._waiting.append(seq)
        self._wake.set()
        try:
            return await asyncio.shield(seq.future)
        except asyncio.CancelledError:
            # The caller gave up: free the slot; nobody reads the partial result.
            self._abort_matching(lambda s: s is seq)
            raise

    def _validate(self, request: GenerateRequest) -> None:
        if not request.input_ids:
            raise InvalidRequestError(f"request {request.rid!r} has no input_ids")
        total = len(request.input_ids) + max(request.max_new_tokens, 0)
        if total > self.max_context_len:
            raise InvalidRequestError(
                f"request {request.rid!r}: {len(request.input_ids)} input tokens + max_new_tokens "
                f"{request.max_new_tokens} exceed the context length {self.max_context_len}; "
                "lower max_new_tokens or shorten the prompt"
            )
        if request.stop and self._detokenize is None:
            raise InvalidRequestError(
                f"request {request.rid!r} has stop strings but this engine has no tokenizer to detect them; "
                "send stop_token_ids"
            )
        vocab = int(self.model.config.vocab_size)
        if min(request.input_ids) < 0 or max(request.input_ids) >= vocab:
            raise InvalidRequestError(f"request {request.rid!r} has token ids outside [0, {vocab})")

    async def abort(self, rid_prefix: str) -> None:
        """Abort requests whose rid starts with ``rid_prefix`` ("" matches all)."""
        self._abort_matching(lambda s: s.request.rid.startswith(rid_prefix))

    async def abort_all(self) -> None:
        """Abort every waiting and running request."""
        self._abort_matching(lambda s: True)

    def _abort_matching(self, match: Callable[[_Sequence], bool]) -> None:
        kept: deque[_Sequence] = deque()
        for seq in self._waiting:
            if match(seq):
                self._finish(seq, "abort")
            else:
                kept.append(seq)
        self._waiting = kept
        for seq in self._running:
            if match(seq) and seq.finish_reason is None:
                seq.abort_requested = True
        self._wake.set()

    async def load(self) -> EngineLoad:
        """Running and waiting request counts (finished-but-unreported rows are not counted)."""
        return self.current_load()

    def current_load(self) -> EngineLoad:
        """Synchronous load(), for metric collectors that cannot await."""
        running = sum(1 for s in self._running if s.finish_reason is None)
        return EngineLoad(running=running, waiting=len(self._waiting))

    def used_tokens(self) -> int:
        """Tokens held in the KV cache by running sequences (for token-usage metrics)."""
        return sum(len(s.request.input_ids) + len(s.output_ids) for s in self._running if s.finish_reason is None)

    def batch_capacity(self) -> int | None:
        """The KV slots: ``max_batch_size`` sequences decode together."""
        return self.max_batch_size

    def ceiling_tokens_per_s(self) -> float | None:
        """Bubble-free ceiling estimate: a full batch per (near-full) decode step time."""
        step = self.stats.full_step_seconds
        return self.max_batch_size / step if step > 0 else None

    async def health(self) -> bool:
        """True once the model is loaded and the decode loop is alive."""
        return self._loop_task is not None and not self._loop_task.done()

    def pause(self) -> None:
        """Stop scheduling steps (requests stay queued/running with their KV) until resume()."""
        self._paused = True

    async def settle(self) -> None:
        """Return once the step in flight (if any) is done: after pause() then settle(), no token is
        produced and no request finishes until resume(), so a load read then stays true."""
        async with self._step_lock:
            pass

    def resume(self) -> None:
        """Undo pause()."""
        self._paused = False
        self._wake.set()

    @property
    def paused(self) -> bool:
        """True between pause() and resume()."""
        return self._paused

    # ----------------------------------------------------------------- weights

    async def update_weights(self, update: WeightUpdate) -> None:
        """Install weights from ``update.tensors``, ``update.module`` (state dict copy) or ``update.path`` between steps.

        The same install as a weight transport's (load_named_tensors, the TensorTarget of
        engines/base.py): the whole state as one bucket, which must then cover the whole model.
        Running sequences keep their KV cache and continue with the new weights, as SGLang does.
        """
        if update.module is None and update.path is None and update.tensors is None:
            raise EngineError("WeightUpdate needs a module or a path (or gathered tensors)")
        async with self._step_lock:
            await asyncio.to_thread(self._install_update, update)
            self.weight_version = update.version
        log.info("embedded engine now serves weight version %s", update.version)

    def served_version(self) -> int | None:
        """The version of the weights in this process's model."""
        return self.weight_version

    async def load_named_tensors(
        self, tensors: list[tuple[str, torch.Tensor]], version: int | None, flush_cache: bool = True,
        *, adopt: bool = False,
    ) -> None:
        """Copy some full named parameters into the served model (one bucket of a weight sync);
        ``version``, given with the last bucket, becomes the served weight version; ``flush_cache``:
        see _copy_named. ``adopt``: the tensors were made for this call alone (received over the
        weight-update group), so a parameter of their dtype takes them as they are, with no copy.

        Raises EngineError naming parameters the model does not have or whose shape differs.
        """
        async with self._step_lock:
            await asyncio.to_thread(self._copy_named, tensors, "a weight sync", False, flush_cache, adopt)
            if version is not None:
                self.weight_version = version
        if version is not None:
            log.info("embedded engine now serves weight version %s", version)

    def _copy_named(
        self, tensors: list[tuple[str, torch.Tensor]], source: str, whole: bool, flush_cache: bool = True,
        adopt: bool = False,
    ) -> None:
        """Copy named tensors into the model's parameters and persistent buffers, by name.

        ``adopt``: a parameter of the tensor's dtype and device takes the tensor itself (its ``data``
        becomes the tensor: a view into the bucket's received buffer), which saves a copy of every
        byte on the receiving side of a sync. On this CPU engine that copy costs about as much per
        byte as receiving it (on a GPU it is a device copy, small beside the broadcast). Only for
        tensors nobody else holds: a trainer's own weights (the ``tensor`` transport) are copied.
        The parameter object stays, so a tied pair stays tied.

        ``flush_cache`` False keeps the interrupted rows (their keys and values stay those of the old
        weights, as SGLang's radix cache does with ``flush_cache`` false); the cached prompt prefills
        go either way, since they hold logits a first token would be sampled from.

        Every name of a tied weight is a target: a sharded trainer's full weights (its state dict) list
        the output head of a tied model (lm_head.weight) beside the embedding it shares (Qwen3 up to
        4B ties them). A ``whole`` state must name every target, and may lack or add the tied pair (a
        checkpoint of a tied model may hold one of the two names); a bucket is a part of the model.
        """
        if self._targets is None:
            self._targets = self.model.state_dict(keep_vars=True)  # raises before start()
        targets = self._targets
        # Cached prefills were computed under the old weights: a first token sampled from them would be
        # stamped with the new version (SGLang flushes its radix cache on every weight update too).
        if flush_cache:
            with torch.inference_mode():  # the KV cache's tensors are inference tensors
                self._compact(keep_interrupted=False)  # free the rows aborted since the last step, unkept
            self.flush_prefix_cache()
        elif self._prefixes is not None:
            self._prefixes.clear()
        self._partials.clear()  # part-way prefills too: those prompts start over under the new weights
        tied = {"lm_head.weight", "model.embed_tokens.weight"} if whole else set()
        given = {n for n, _ in tensors}
        unknown = sorted(given - set(targets) - tied)
        missing = sorted(set(targets) - given - tied) if whole else []
        wrong = [n for n, t in tensors if n in targets and targets[n].shape != t.shape]
        if unknown or missing or wrong:
            raise EngineError(
                f"weights from {source} do not match the served model "
                f"(unknown {unknown[:5]}, missing {missing[:5]}, wrong shape {wrong[:5]})"
            )
        with torch.no_grad():
            for name, tensor in tensors:
                if name not in targets:
                    continue
                target = targets[name]
                if adopt and isinstance(target, torch.nn.Parameter) and (target.dtype, target.device) == (
                        tensor.dtype, tensor.device):
                    target.data = tensor
                else:
                    target.copy_(tensor)

    def _install_update(self, update: WeightUpdate) -> None:
        if update.tensors is not None:
            state, source = update.tensors, "gathered tensors"
        elif update.module is not None:
            state, source = update.module.state_dict(), type(update.module).__name__
        else:
            assert update.path is not None
            state, source = _load_model(update.path, self._device, self._dtype).state_dict(), update.path
        self._copy_named(list(state.items()), source, whole=True, flush_cache=update.flush_cache)

    def sampling_state(self) -> torch.Tensor | None:
        """The sampling generator's state (None before start())."""
        return self._generator.get_state() if self._generator is not None else None

    def load_sampling_state(self, state: torch.Tensor | None) -> None:
        """Restore the sampling generator (after start(), which seeds it)."""
        if state is not None and self._generator is not None:
            self._generator.set_state(state)

    # ----------------------------------------------------------------- decode loop

    async def _decode_loop(self) -> None:
        while True:
            self._finish_aborted_running()
            if self._paused or not (self._waiting or any(s.finish_reason is None for s in self._running)):
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._step_lock:
                free = self.max_batch_size - sum(1 for s in self._running if s.finish_reason is None)
                admitted = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
                self._running.extend(admitted)
                started = time.perf_counter()
                prefills_before = self.stats.prefill_steps
                try:
                    produced = await asyncio.to_thread(self._step, admitted)
                except Exception as exc:  # a broken step must not kill the loop or strand callers
                    log.exception("embedded engine step failed; failing the running requests")
                    self._fail_running(EngineError(f"embedded engine step failed: {exc}"))
                    continue
                elapsed = time.perf_counter() - started
            self.stats.busy_seconds += elapsed
            self.stats.generated_tokens += produced
            self.stats.last_step_tokens_per_s = produced / elapsed if elapsed > 0 else 0.0
            if not admitted and self.stats.prefill_steps == prefills_before and produced * 2 >= self.max_batch_size:
                # Decode-only steps near full batch estimate the bubble-free step time.
                avg = self.stats.full_step_seconds
                self.stats.full_step_seconds = elapsed if avg == 0 else 0.9 * avg + 0.1 * elapsed
            self._finish_aborted_running()
            for seq in self._running:
                if seq.finish_reason is not None and not seq.future.done():
                    self._finish(seq, seq.finish_reason)
            # Let aborts and new requests in before the next step.
            await asyncio.sleep(0)

    def _finish_aborted_running(self) -> None:
        for seq in self._running:
            if seq.abort_requested and seq.finish_reason is None:
                seq.finish_reason = "abort"
                self._finish(seq, "abort")

    def _result_of(
        self, request: GenerateRequest, ids: list[int], logprobs: list[float], reason: FinishReason, cached: int = 0
    ) -> GenerateResult:
        return GenerateResult(
            rid=request.rid,
            output_ids=list(ids),
            output_logprobs=list(logprobs),
            finish_reason=reason,
            weight_version=self.weight_version,
            prompt_tokens=len(request.input_ids),
            cached_tokens=cached,
        )

    def _finish(self, seq: _Sequence, reason: FinishReason) -> None:
        if seq.future.done():
            return
        self.stats.finished[reason] += 1
        seq.future.set_result(self._result_of(seq.request, seq.output_ids, seq.output_logprobs, reason, seq.cached_tokens))

    def _fail_running(self, error: EngineError) -> None:
        for seq in self._running:
            if not seq.future.done():
                seq.future.set_exception(error)
        self._running, self._cache = [], None
        self._partials.clear()

    # ----------------------------------------------------------------- torch work (worker thread)

    def _step(self, admitted: list[_Sequence]) -> int:
        """Free finished rows, prefill ``admitted``, decode one token for all; returns tokens produced."""
        with torch.inference_mode():
            self._compact()
            admitted = self._resume_interrupted(admitted)
            if self.chunked_prefill_tokens:
                return self._chunked_step(admitted)
            produced = 0
            if admitted:
                produced += self._prefill(admitted)
            if any(s.finish_reason is None and not s.abort_requested for s in self._running):
                produced += self._decode()
            return produced

    def _kv(self) -> SlotKVCache:
        if self._cache is None:
            self._cache = SlotKVCache(self.model.config, self.max_batch_size, self._device, self._dtype)
        return self._cache

    def _compact(self, keep_interrupted: bool = True) -> None:
        """Release the slots of sequences that finished (by stop/length/abort) since the last step; the
        rows of aborted ones are kept for their resumption unless ``keep_interrupted`` is False."""
        kept: list[_Sequence] = []
        for seq in self._running:
            if seq.finish_reason is None:
                kept.append(seq)
            elif seq.slot is not None:
                if keep_interrupted and seq.finish_reason == "abort" and seq.output_ids and self._interrupted is not None:
                    # The row holds every token but the last sampled one: what the resumed sample needs.
                    keys, values = self._kv().row(seq.slot)
                    self._interrupted.put([*seq.request.input_ids, *seq.output_ids], Interrupted(keys, values))
                self._kv().release(seq.slot)
                seq.slot = None
        self._running = kept

    def _resume_interrupted(self, admitted: list[_Sequence]) -> list[_Sequence]:
        """Put the admitted sequences that resume an interrupted row (all their ids but the last held)
        straight into slots: no prefill, their last id is fed by this step's decode. Returns the others."""
        if self._interrupted is None or not len(self._interrupted):
            return admitted
        rest: list[_Sequence] = []
        for seq in admitted:
            ids = seq.request.input_ids
            # Kept after use, as in a radix tree: identical samples (greedy ones) resume from one row.
            entry = self._interrupted.get(ids) if seq.request.max_new_tokens > 0 else None
            if entry is None:
                rest.append(seq)
                continue
            kv = self._kv()
            kv.reserve(len(ids) + seq.request.max_new_tokens)
            seq.slot = kv.allocate()
            kv.admit([seq.slot], entry.keys, entry.values, torch.tensor([ids[-1]], dtype=torch.long, device=self._device))
            seq.cached_tokens = entry.tokens
            self.stats.cached_prefill_tokens += entry.tokens
            self.stats.resumed_without_prefill += 1
        return rest

    def _forward(
        self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache | SlotKVCache
    ) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    def _prefill(self, seqs: list[_Sequence]) -> int:
        """Prefill the admitted sequences in length buckets; samples each one's first token."""
        kv = self._kv()
        kv.reserve(max(len(s.request.input_ids) + s.request.max_new_tokens for s in seqs))
        return sum(self._prefill_chunk(chunk, kv) for chunk in prefill_chunks(seqs, lambda s: len(s.request.input_ids)))

    def _prefill_chunk(self, seqs: list[_Sequence], kv: SlotKVCache) -> int:
        """Prefill prompts of similar length, each distinct prompt at most once, into fresh KV slots.

        With a prefix cache, sequences with the same token ids form one group: their prompt comes from
        the cache or from one row of this chunk's forward, and every member copies it into its own slot.
        Without one, each sequence is a group of its own. Either way the first tokens are sampled in one
        call over the chunk's sequences in order, so both paths draw the same random numbers.
        Returns the tokens sampled (prefill-only requests, ``max_new_tokens`` 0, sample none).
        """
        groups: dict[_GroupKey, list[_Sequence]] = {}
        for seq in seqs:
            groups.setdefault(self._group_key(seq), []).append(seq)
        prefills = self._prefills_of(groups)
        sampled = [s for s in seqs if s.request.max_new_tokens > 0]
        first: dict[int, torch.Tensor] = {}  # id(sequence) -> its first token
        if sampled:
            logits = torch.stack([prefills[self._group_key(s)].logits for s in sampled])
            tokens, logprobs = sample_tokens(logits, [s.sampling for s in sampled], self._generator)
            for seq, tok, lp in zip(sampled, tokens.tolist(), logprobs.tolist(), strict=True):
                seq.take(int(tok), float(lp), self._detokenize)
            first = dict(zip(map(id, sampled), tokens.unbind(), strict=True))
        for key, members in groups.items():
            self._admit(members, prefills[key], first, kv)
        return len(sampled)

    def _admit(self, members: list[_Sequence], prefill: Prefill, first: dict[int, torch.Tensor], kv: SlotKVCache) -> None:
        """Copy a finished prefill into a fresh KV slot per member that generates (``first``: id(sequence) ->
        its first token, already taken); prefill-only members are done."""
        for seq in members:
            if seq.request.max_new_tokens <= 0:
                seq.finish_reason = "length"  # prefill-only: done once its prompt is in the cache
        live = [s for s in members if s.request.max_new_tokens > 0]
        if live:
            slots = [kv.allocate() for _ in live]
            for seq, slot in zip(live, slots, strict=True):
                seq.slot = slot
            kv.admit(slots, prefill.keys, prefill.values, torch.stack([first[id(s)] for s in live]))

    def _prefills_of(self, groups: dict[_GroupKey, list[_Sequence]]) -> dict[_GroupKey, Prefill]:
        """Each group's prefill: from the prefix cache, else from one forward over the groups missing.
        The member whose prompt ran through the model paid for it; every other member reused it."""
        prefills: dict[_GroupKey, Prefill] = {}
        missing: list[_GroupKey] = []
        for key, members in groups.items():
            cached = self._prefixes.get(members[0].request.input_ids) if self._prefixes is not None else None
            if cached is not None:
                prefills[key] = cached
            else:
                missing.append(key)
        if missing:
            computed = self._forward_prompts([groups[k][0].request.input_ids for k in missing])
            prefills.update(zip(missing, computed, strict=True))
        fresh = set(missing)
        for key, members in groups.items():
            self._count_shared(members[1:] if key in fresh else members)
        return prefills

    def _count_shared(self, seqs: list[_Sequence]) -> None:
        """These sequences took their whole prompt from a prefill they did not compute."""
        for seq in seqs:
            seq.cached_tokens = len(seq.request.input_ids)
            self.stats.cached_prefill_tokens += seq.cached_tokens

    def _group_key(self, seq: _Sequence) -> _GroupKey:
        """Sequences that share a prefill: the same token ids with a prefix cache, else each on its own."""
        return tuple(seq.request.input_ids) if self._prefixes is not None else id(seq)

    def _forward_prompts(self, prompts: list[list[int]]) -> list[Prefill]:
        """One left-padded forward over ``prompts``; each one's valid keys, values and last logits
        (kept in the prefix cache when there is one)."""
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long, device=self._device)
        mask = torch.zeros((len(prompts), width), dtype=torch.long, device=self._device)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids, mask, positions, cache)
        self.stats.prefill_steps += 1
        self.stats.prefill_tokens += int(mask.sum())
        # transformers types a cache's layers as a union with linear-attention layers (no keys/values);
        # a prefill of these models holds attention layers only.
        layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (layer.keys, layer.values) for layer in cache.layers  # type: ignore[union-attr, misc]
        ]
        out: list[Prefill] = []
        for row, prompt in enumerate(prompts):
            lo = width - len(prompt)  # padded columns are left out: they may hold NaN from empty attention
            prefill = Prefill(keys=[k[row, :, lo:] for k, _ in layers], values=[v[row, :, lo:] for _, v in layers],
                              logits=logits[row])
            if self._prefixes is not None:
                # A copy: a view would keep the whole padded batch alive for as long as the entry lives.
                prefill = Prefill([k.clone() for k in prefill.keys], [v.clone() for v in prefill.values],
                                  prefill.logits.clone())
                self._prefixes.put(prompt, prefill)
            out.append(prefill)
        return out

    def _decode(self) -> int:
        """One forward over the slot rows; free and finished rows are computed but ignored."""
        kv = self._kv()
        ids, positions, mask = kv.decode_inputs()
        logits = self._forward(ids, mask, positions, kv)
        live = [s for s in self._running if s.finish_reason is None and s.slot is not None]
        slots = [s.slot for s in live if s.slot is not None]
        rows = torch.tensor(slots, dtype=torch.long, device=self._device)
        tokens, logprobs = sample_tokens(logits.index_select(0, rows), [s.sampling for s in live], self._generator)
        kv.advance(slots, tokens)
        for seq, tok, lp in zip(live, tokens.tolist(), logprobs.tolist(), strict=True):
            seq.take(int(tok), float(lp), self._detokenize)
        self.stats.decode_steps += 1
        return len(live)

    # ----------------------------------------------------------------- chunked prefill (chunked_prefill.py)

    def _chunked_step(self, admitted: list[_Sequence]) -> int:
        """One step with prefill mixed into the decode forward; returns the tokens produced.

        Prompts already in the prefix cache are admitted first, with no forward (they decode in this step,
        as after an unchunked prefill). Then one forward runs every decode row and the next chunks of the
        other waiting prompts, oldest first, at most ``chunked_prefill_tokens`` prompt tokens; a prompt
        finished by it samples its first token there and decodes from the next step on.
        """
        kv = self._kv()
        if admitted:
            kv.reserve(max(len(s.request.input_ids) + s.request.max_new_tokens for s in admitted))
        groups: dict[_GroupKey, list[_Sequence]] = {}
        for seq in self._running:
            if seq.slot is None and seq.finish_reason is None and not seq.abort_requested:
                groups.setdefault(self._group_key(seq), []).append(seq)
        # A prompt nobody waits for any more (its requests aborted) drops its partial prefill. (Without a
        # prefix cache the key is id(sequence): dropped here in the step its sequence left, before any
        # later sequence could reuse the id.)
        self._partials = {key: partial for key, partial in self._partials.items() if key in groups}
        produced = 0
        cached = [key for key in groups
                  if self._prefixes is not None and self._prefixes.get(groups[key][0].request.input_ids) is not None]
        if cached:
            produced += self._prefill_chunk([seq for key in cached for seq in groups[key]], kv)
        todo = [(key, len(members[0].request.input_ids), self._partial_tokens(key))
                for key, members in groups.items() if key not in cached]
        plan = plan_pieces(todo, self.chunked_prefill_tokens) if todo else []
        if plan:
            pieces = {p.key: Piece(groups[p.key][0].request.input_ids, p.start, p.end, self._partials.get(p.key))
                      for p in plan}
            produced += self._mixed_forward(pieces, groups, kv)
        elif any(s.finish_reason is None and s.slot is not None for s in self._running):
            produced += self._decode()
        return produced

    def _partial_tokens(self, key: _GroupKey) -> int:
        partial = self._partials.get(key)
        return partial.tokens if partial is not None else 0

    def _mixed_forward(self, pieces: dict[_GroupKey, Piece], groups: dict[_GroupKey, list[_Sequence]],
                       kv: SlotKVCache) -> int:
        """One forward over the decode rows and ``pieces``; samples the decodes' next tokens and the first
        token of every prompt a piece finishes (one sampling call), then admits those prompts to KV slots."""
        decoding = [s for s in self._running if s.finish_reason is None and s.slot is not None]
        ids = positions = mask = None
        if decoding:
            ids, positions, mask = kv.decode_inputs()
        rows = int(ids.shape[0]) if ids is not None else 0
        batch = MixedBatch(kv if rows else None, rows, mask, list(pieces.values()))
        input_ids, position_ids = batch.inputs(ids, positions, self._device)
        done = [key for key, piece in pieces.items() if piece.completes]
        span_of = dict(zip(pieces, batch.spans, strict=True))
        keep = torch.tensor([s.slot for s in decoding if s.slot is not None] + [span_of[k][1] - 1 for k in done],
                            dtype=torch.long, device=self._device)
        out = self.model(
            input_ids=input_ids,
            # Used as given (a 4D mask): the decode rows' mask; mixed_attention builds the pieces' own.
            attention_mask=mask if mask is not None else torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self._device),
            position_ids=position_ids,
            cache=batch,
            use_cache=True,
            logits_to_keep=keep,
            mixed_batch=batch,
        )
        logits = out.logits[0]
        self.stats.prefill_steps += 1
        self.stats.prefill_tokens += sum(p.end - p.start for p in pieces.values())
        # (logits cloned: a view would keep every kept row alive with a cached prefill)
        finished = {key: Prefill(pieces[key].keys, pieces[key].values, logits[len(decoding) + i].clone())
                    for i, key in enumerate(done)}
        for key, piece in pieces.items():
            if not piece.completes:
                self._partials[key] = piece.after()
        # One sampling call: the decodes first, then each finished prompt's members.
        firsts = [s for key in done for s in groups[key] if s.request.max_new_tokens > 0]
        rows_logits = [logits[: len(decoding)]] + [finished[k].logits.expand(
            sum(1 for s in groups[k] if s.request.max_new_tokens > 0), -1) for k in done]
        params = [s.sampling for s in decoding] + [s.sampling for s in firsts]
        first: dict[int, torch.Tensor] = {}
        if params:
            tokens, logprobs = sample_tokens(torch.cat(rows_logits), params, self._generator)
            if decoding:
                kv.advance([s.slot for s in decoding if s.slot is not None], tokens[: len(decoding)])
                self.stats.decode_steps += 1
                self.stats.mixed_steps += 1
            for seq, tok, lp in zip(decoding + firsts, tokens.tolist(), logprobs.tolist(), strict=True):
                seq.take(int(tok), float(lp), self._detokenize)
            first = dict(zip(map(id, firsts), tokens[len(decoding) :].unbind(), strict=True))
        for key in done:
            self._partials.pop(key, None)
            if self._prefixes is not None:
                self._prefixes.put(groups[key][0].request.input_ids, finished[key])
            self._count_shared(groups[key][1:])
            self._admit(groups[key], finished[key], first, kv)
        return len(params)
