"""The synchronous heart of an engine: one call of :meth:`EngineCore.step` runs one iteration of
continuous batching (schedule → model → sample → update) and reports what each request produced.

It owns the :class:`pagedkv.Scheduler`, a model runner and each request's sampling state. Time comes
from an injectable clock, so a simulated model can run on virtual time with the same bookkeeping.

Invariants:

- ``step`` owns the scheduler's schedule/update protocol: every ``schedule()`` it makes is followed
  by ``update()`` before it returns or raises, whether the step ran nothing, the model failed, or a
  request was aborted meanwhile. Nothing else calls either.
- A request is in the scheduler exactly when it is in ``_requests``: a lock guards the two, so
  ``add_request`` and ``abort`` may come from any thread while another runs ``step``. The model,
  the sampler and the output processing (:mod:`pagedkv.engine.output_processor`: detokenizing,
  stop strings) run outside that lock; a request's output is changed only under its own lock,
  which the step appending its tokens and an abort ending it both take, so an abort meanwhile
  either comes after the step's tokens or leaves them out.
- Arguments are checked once: the scheduler checks everything it receives; this module adds only
  what the scheduler cannot know (the vocabulary, the type of the sampling parameters, the model's
  longest position).
- With a tokenizer, each sample's text is built here, incrementally
  (:mod:`pagedkv.text.detokenizer`): every :class:`TokenEvent` carries its text delta, the deltas
  concatenate to :attr:`CompletionOutput.text`, and that is ``tokenizer.decode(token_ids)`` unless
  a stop string cut it (or the sample ended without a last token — aborted, failed — when the
  text still held back is dropped, as it was never streamed). A sample whose stop string
  completes ends with ``finish_reason == "stop"`` in the step that completed it, and leaves the
  scheduler in that same step (its blocks freed, never sampled again): alone
  (``Scheduler.finish_sample``) while other samples of its request run, else with its request
  (aborted).
  A tokenizer that raises (anything, ``SystemExit`` included: :mod:`pagedkv.callbacks`) fails
  the request alone, like NaN logits.
- Sampling state is per sample: its generator (seeded by (seed, sample index)) and, only for a
  request with a penalty on, its :class:`~pagedkv.sampling.TokenHistory` (the prompt's,
  copied for each of the n samples, plus every token appended to its output): a row's draw
  depends on nothing else in its batch. With ``logprobs`` asked, each token appended to a
  sample's ``token_ids`` appends its :class:`TokenLogprob` to ``logprobs`` and rides its
  :class:`TokenEvent`; a token not kept (after a stop string, aborted) leaves neither, so
  ``len(logprobs) == len(token_ids)`` always.
- A sample row the model left nothing to draw from (:data:`~pagedkv.sampling.NO_TOKEN`: NaN
  logits), or whose parameters the sampling kernel refused (:attr:`Samples.refused`), fails its
  request alone: it ends with ``finish_reason == "error"`` and ``error`` set.
  A runner that raises aborts the requests of its step (their blocks freed, the protocol completed)
  and the exception propagates; what the step wrote to the KV cache is then undefined, so the
  caller should stop using this core (the threaded engine does).
- :attr:`RequestOutput.num_cached_tokens` is set from the scheduler's "admitted" event of the
  step that first admits the request. With a tracer (:mod:`pagedkv.observability.tracing`), it sees each request
  added, each step (after its update) and each end; without one, each costs one ``is None`` test.
  What the tracer raises is logged and ignored (:mod:`pagedkv.callbacks`).
- KV events (``emit_kv_events``) are recorded into :attr:`kv_events` under the lock (a step's
  after its update, in ``kv_snapshot`` and ``close`` those pending) and delivered to its
  subscribers after the lock is released, in the thread that recorded them: a subscriber may call
  ``kv_snapshot``, ``add_request`` or ``abort``. Only KV cache group 0's blocks are published
  (and snapshot): a full-attention group in blocks of the configured size whenever the model has
  one, whose hashes are those a router computes for a prompt; a hybrid model's other groups chain
  their hashes from roots of their own, which no router would find (``Scheduler.take_kv_events``
  has them all).
- Per-sample state (histories, generators, texts) is built only once the scheduler has accepted
  the request, and so its ``n``: a refused request costs nothing per sample.
- A request with ``structured_outputs`` has its grammar compiled (:attr:`grammars`, a bounded
  cache) before the scheduler sees it, so one that does not compile changes nothing; each of its
  samples then has a matcher (:mod:`pagedkv.engine.constraints`). A step starts the masks of its
  constrained rows on the worker pool before the runner runs; the runner applies them when it
  samples. Each kept token advances its sample's matcher in :meth:`_append`; a sample whose
  grammar has finished ends there with "stop", as a stop string ends it.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pagedkv._core import Grammar, GrammarMatcher, KvSpec, Scheduler, SchedulerOutput
from pagedkv.callbacks import call_guarded
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.constraints import GrammarStats, StepMasks, matchers_of
from pagedkv.engine.output_processor import append_token
from pagedkv.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenEvent, TokenLogprob
from pagedkv.engine.prompt_scoring import ScoreRows, rows_of, scoring_salt
from pagedkv.engine.runners import ModelRunner
from pagedkv.errors import InvalidArgumentError
from pagedkv.grammar import GrammarCompiler
from pagedkv.kv_events import AllBlocksCleared, KvEventPublisher, KvSnapshot
from pagedkv.sampling import NO_TOKEN, Samples, SamplingParams, TokenHistory
from pagedkv.text.detokenizer import SampleText
from pagedkv.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pagedkv.observability.tracing import RequestTracer

__all__ = ["EngineCore"]


_log = logging.getLogger(__name__)

# How long a step with nothing to run but sequences loading from the disk tier sleeps: a tiny
# model's block loads in ~0.05 ms, so a wait rarely costs more than this (spinning cost a core).
_LOAD_WAIT_SECONDS = 0.0002

@dataclass(frozen=True)
class KvGroup:
    """One KV cache group of the model's layout, now: its layers, its window (None: it keeps every
    token), the blocks its tables hold, and the tokens a block of it holds (a sliding group's
    blocks may be smaller than the configured size: its pages carved, ``KvSpec``)."""

    layers: list[int]
    window: int | None
    blocks_in_use: int
    block_size: int

    @property
    def attention(self) -> str:
        """What it keeps: "full", or "sliding:<window>"."""
        return "full" if self.window is None else f"sliding:{self.window}"


@dataclass
class _Request:
    params: SamplingParams
    generators: list[np.random.Generator]
    output: RequestOutput
    texts: list[SampleText] | None  # per sample; None without a tokenizer
    histories: list[TokenHistory] | None  # per sample; None without a penalty
    matchers: list[GrammarMatcher] | None  # per sample; None without structured outputs
    # The output's: held by the step appending tokens (outside the core's lock) and by an abort
    # ending it, so neither sees the other's half-made change.
    lock: threading.Lock = field(default_factory=threading.Lock)


# A token an update produced: (its request, request id, sample index, token, the scheduler's
# finish reason or None).
_Produced = tuple[_Request, str, int, int, "str | None"]

# The KV cache group whose blocks the engine publishes as KV events (module doc).
ROUTED_KV_GROUP = 0


class EngineCore:
    """Scheduler + model runner + per-request state, stepped by one thread; requests may be added
    and aborted from any thread."""

    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig = EngineConfig(),
        eos_token_ids: Sequence[int] = (),
        clock: Callable[[], float] = time.perf_counter,
        tokenizer: Tokenizer | None = None,
        tracer: RequestTracer | None = None,
        model_identity: bytes | None = None,
    ) -> None:
        """Raises :class:`InvalidArgumentError` for a ``max_model_len`` past the model's longest
        position (``runner.max_model_len``), and whatever the scheduler refuses in ``config``.
        With a ``tokenizer``, outputs carry text and requests may have stop strings. With a
        ``tracer`` (:func:`pagedkv.observability.tracing.configure`), each request is traced. A disk tier
        (``config.kv_disk_path``) needs a runner that keeps K/V and the ``model_identity``
        (:func:`pagedkv.loaders.identity.kv_identity`) it records; one that cannot be opened raises
        :class:`~pagedkv.errors.KvTierError`."""
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.clock = clock
        if not isinstance(config.hybrid_kv_cache, bool):
            raise InvalidArgumentError(f"hybrid_kv_cache must be a bool, got {config.hybrid_kv_cache!r}")
        spec = runner.kv_spec
        if spec is not None:
            spec = KvSpec(
                spec.layers, spec.dtype, hybrid=config.hybrid_kv_cache, sliding_block_size=config.sliding_block_size
            )
        max_model_len = config.max_model_len
        if max_model_len is None:
            held = config.num_blocks * config.block_size  # one full-attention group: the whole cache
            if spec is not None:  # several groups (sliding windows): what fits in all of them
                held = spec.capacity_tokens(config.num_blocks, config.block_size, config.max_num_batched_tokens)
            max_model_len = min(runner.max_model_len, held)
        options = config.scheduler_options() | {"max_model_len": max_model_len}
        self.scheduler = Scheduler(**options, eos_token_ids=list(eos_token_ids), kv_spec=spec)  # type: ignore[arg-type]
        self.max_model_len: int = self.scheduler.max_model_len  # as the scheduler validated it
        if self.max_model_len > runner.max_model_len:
            raise InvalidArgumentError(f"max_model_len {self.max_model_len} exceeds the model's {runner.max_model_len} positions")
        # KV events (for a router): the scheduler records them only when asked; the core numbers
        # them under its lock (so kv_snapshot is consistent with their numbers) after every step,
        # and hands them to subscribers once it has released the lock.
        self.kv_events = KvEventPublisher(clock=clock)
        self._emit_kv_events = config.emit_kv_events
        # What attaching the disk tier reported (blocks recovered, whether a foreign tier was
        # cleared); None without a tier.
        self.disk_tier: dict[str, int | bool] | None = None
        tier = config.disk_tier()
        if tier is not None:
            if runner.kv_spec is None or model_identity is None:
                raise InvalidArgumentError("a disk tier needs a model runner that keeps K/V and the model's identity")
            directory, capacity = tier
            self.disk_tier = self.scheduler.attach_disk_tier(str(directory), capacity, model_identity)
        self._tier_attached = self.disk_tier is not None  # until close()
        self._lock = threading.Lock()  # guards _requests with the scheduler's request set
        self._requests: dict[str, _Request] = {}
        # The scheduler's output of the latest step (its arrays and per-step ``stats``), None
        # before the first: what benchmarks and tracing read about a step.
        self.last_step: SchedulerOutput | None = None
        self._tracer = None if tracer is None else tracer.observe(clock)
        # Structured outputs: compiled once per distinct constraint (a bounded cache), masked per step.
        self.grammars = GrammarCompiler(tokenizer, runner.vocab_size, eos_token_ids)
        self._grammar_stats = GrammarStats()

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> RequestOutput:
        """Queues a request; returns its (empty) output record. Raises, changing nothing:
        :class:`InvalidArgumentError` for a prompt (or a ``logit_bias``) that is not token ids of
        the model's vocabulary or ``params`` that are not :class:`SamplingParams`, and whatever
        the scheduler refuses (a duplicate id, an empty or too long prompt, out-of-range limits, arguments of the
        wrong type), and stop strings without a tokenizer. ``trace_headers`` (W3C ``traceparent``)
        make the request's trace a child of the caller's."""
        token_ids = _vocabulary_tokens(prompt_token_ids, self.runner.vocab_size)
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise InvalidArgumentError("stop strings need text: this engine core has no tokenizer")
        biased = [token for token, _ in params.logit_bias if token >= self.runner.vocab_size]  # type: ignore[union-attr]
        if biased:
            raise InvalidArgumentError(f"logit_bias token ids {biased[:5]} outside the vocabulary of {self.runner.vocab_size}")
        if params.prompt_logprobs is not None:
            if not getattr(self.runner, "scores_prompts", False):
                raise InvalidArgumentError("prompt_logprobs needs a model with logits at every position (this runner has none)")
            cache_salt = scoring_salt(request_id, cache_salt)
        # Compiled before the scheduler sees the request (outside the lock: a big schema takes
        # milliseconds), so a constraint that does not compile changes nothing.
        grammar = None if params.structured_outputs is None else self.grammars.compile(params.structured_outputs)
        arrival = self.clock() if arrival_time is None else arrival_time
        with self._lock:
            # The scheduler validates n (with every other limit) before any per-sample work:
            # n = 10**7 with a penalty cost 40 s and 2.2 GB of history copies when they came first.
            self.scheduler.add_request(
                request_id,
                token_ids,
                max_tokens=params.max_tokens,
                stop_token_ids=list(params.stop_token_ids),
                ignore_eos=params.ignore_eos,
                n=params.n,
                priority=priority,
                arrival_time=arrival,
                cache_salt=cache_salt,
            )
            try:
                request = self._new_request(request_id, token_ids, params, prompt, arrival, grammar)
            except BaseException:
                self.scheduler.abort(request_id)  # e.g. MemoryError: the refused request leaves no trace
                raise
            self._requests[request_id] = request
            if self._tracer is not None:
                call_guarded(self._tracer.queued, request.output, params, trace_headers, what="tracer")
        return request.output

    def _new_request(
        self, request_id: str, token_ids: list[int], params: SamplingParams, prompt: str | None, arrival: float,
        grammar: Grammar | None,
    ) -> _Request:
        """The per-sample state of a request the scheduler has accepted (so ``params.n`` is at
        most ``max_num_seqs``): its outputs, generators, texts, (with a penalty) histories and (with
        a ``grammar``) matchers."""
        n = params.n
        histories = None
        if params.penalized:  # O(prompt) once; presence/frequency see only the output
            history = TokenHistory(token_ids, with_prompt=params.repetition_penalty != 1)
            histories = [history] + [history.copy() for _ in range(n - 1)]
        output = RequestOutput(
            request_id=request_id,
            prompt_token_ids=token_ids,
            outputs=[CompletionOutput(index=i, logprobs=[] if params.logprobs else None) for i in range(n)],
            metrics=RequestMetrics(arrival_time=arrival),
            prompt=prompt,
            prompt_logprobs=None if params.prompt_logprobs is None else [None] * len(token_ids),
        )
        generators = [params.make_generator(i) for i in range(n)]
        tokenizer = self.tokenizer
        texts = None if tokenizer is None else [SampleText(tokenizer, params.stop) for _ in range(n)]
        structured = params.structured_outputs
        matchers = None if grammar is None or structured is None else matchers_of(grammar, n, structured.continued_from)
        return _Request(params, generators, output, texts, histories, matchers)

    def abort(self, request_id: str) -> RequestOutput:
        """Stops a request in any state, freeing its blocks; returns its final output. Raises
        :class:`pagedkv.UnknownSequenceError` for a request that is not waiting or running."""
        with self._lock:
            self.scheduler.abort(request_id)
            request = self._requests.pop(request_id)
        with request.lock:  # after the tokens a step is appending to it, if any
            for completion in request.output.outputs:
                completion.finish_reason = completion.finish_reason or "abort"
            self._finish(request.output)
        return request.output

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return self.scheduler.has_unfinished()

    def step(self) -> tuple[list[TokenEvent], list[RequestOutput]]:
        """Runs one iteration; returns the tokens produced and the requests that ended (finished,
        or failed: see the module doc). A step with nothing to run still completes the protocol."""
        started = self.clock()
        with self._lock:
            step = self.scheduler.schedule()
            self.last_step = step
            requests = [self._requests[rid] for rid in step.sample_request_ids]
            row_requests = [self._requests.get(rid) for rid in step.request_ids] if self._requests else []
            for request_id, _, kind, hit in step.events:
                if kind == "admitted":
                    self._requests[request_id].output.num_cached_tokens = hit
        updated = False
        samples = None
        try:
            if step.num_scheduled_tokens == 0:
                tokens = np.empty(0, dtype=np.int64)
            else:
                indices = step.sample_seq_indices.tolist()
                params = [r.params for r in requests]
                generators = [r.generators[i] for r, i in zip(requests, indices, strict=True)]
                histories = [None if r.histories is None else r.histories[i] for r, i in zip(requests, indices, strict=True)]
                scoring, scored = _scoring(step, row_requests)
                masks = self._start_masks(requests, indices)
                extra = {} if masks is None else {"masks": masks}  # a runner without constraints takes none
                if scoring is None:
                    samples = self.runner.run(step, params, generators, histories, **extra)
                else:
                    samples = self.runner.run(step, params, generators, histories, scoring, **extra)
                    self._keep_scores(scored, samples)
                tokens = np.asarray(samples.tokens, dtype=np.int64)
            now = self.clock()
            with self._lock:
                failed = self._fail_unsampled(step, tokens, {} if samples is None else samples.refused)
                # The failed requests' rows are skipped: any valid id stands in for their tokens.
                update = self.scheduler.update(step, np.where(tokens == NO_TOKEN, 0, tokens))
                updated = True
                if self._tracer is not None:
                    call_guarded(self._tracer.step, step, update.request_ids, started, now, what="tracer")
                produced, done = self._take_produced(update)
                self._record_kv_events()
        finally:
            if not updated:
                self._abandon(step)
        # Outside the lock (detokenizing holds up no add_request or abort of another request).
        events, ended, stopped = self._append(produced, now, _logprobs_by_sample(step, requests, samples))
        with self._lock:
            done |= self._settle(ended, stopped)
        self.kv_events.deliver()  # outside the lock: a subscriber may call back into the engine
        for output in failed:
            self._finish(output, now)
        finished = [request.output for request in done.values()]
        for output in finished:
            self._finish(output, now)
        if step.num_scheduled_tokens == 0 and self.scheduler.num_loading:
            # Only loads from the disk tier are left to wait for: yield the CPU to the tier's
            # thread instead of spinning on empty steps (holding no lock, so requests still come in).
            time.sleep(_LOAD_WAIT_SECONDS)
        return events, failed + finished

    def _start_masks(self, requests: Sequence[_Request], indices: Sequence[int]) -> StepMasks | None:
        """Starts computing the masks of the step's constrained sample rows on the worker pool
        (None when it has none)."""
        rows = [row for row, request in enumerate(requests) if request.matchers is not None]
        if not rows:
            return None
        matchers = [requests[row].matchers[indices[row]] for row in rows]  # type: ignore[index]
        return StepMasks(rows, matchers, self._grammar_stats)

    @staticmethod
    def _keep_scores(scored: list[tuple[_Request, np.ndarray]], samples: Samples) -> None:
        """Writes each scored prompt position's :class:`TokenLogprob` into its request's output."""
        scores = samples.prompt_scores
        assert scores is not None, "a runner given scoring rows returns their scores"
        at = 0
        for request, positions in scored:
            k = request.params.prompt_logprobs or 0
            with request.lock:
                entries = request.output.prompt_logprobs
                assert entries is not None
                for j, position in enumerate(positions.tolist()):
                    row = at + j
                    top = tuple(zip(scores.top_ids[row, :k].tolist(), scores.top_logprobs[row, :k].tolist(), strict=True))
                    token = request.output.prompt_token_ids[position]
                    entries[position] = TokenLogprob(token, float(scores.logprobs[row]), top)
            at += len(positions)

    def _fail_unsampled(self, step: SchedulerOutput, tokens: np.ndarray, refused: Mapping[int, str]) -> list[RequestOutput]:
        """Aborts (in the scheduler) the requests with a sample row the model left no token for
        (or the sampler ``refused``, by row), so the coming update skips their rows; returns
        their outputs, marked failed."""
        failed: list[RequestOutput] = []
        if not (tokens == NO_TOKEN).any():
            return failed
        unsampled: dict[str, str] = {}  # request id -> why, its first failed row's reason
        for row, (request_id, token) in enumerate(zip(step.sample_request_ids, tokens.tolist(), strict=True)):
            if token == NO_TOKEN and request_id not in unsampled:
                reason = refused.get(row)
                unsampled[request_id] = (
                    "the model gave NaN logits, or no token a finite logit"
                    if reason is None
                    else f"the sampler refused its parameters: {reason}"
                )
        for request_id, why in unsampled.items():
            request = self._requests.pop(request_id, None)
            if request is None:
                continue  # aborted by another thread since the step was scheduled
            self.scheduler.abort(request_id)
            request.output.error = why
            for completion in request.output.outputs:
                completion.finish_reason = "error"
            failed.append(request.output)
        return failed

    def _take_produced(self, update) -> tuple[list[_Produced], dict[str, _Request]]:
        """Under the lock, right after ``update``: each produced token as (its request, request
        id, sample index, token, the scheduler's finish reason), and the requests the scheduler
        finished, popped (an abort can no longer reach them)."""
        produced = [
            (self._requests[request_id], request_id, index, token, reason)
            for request_id, index, token, reason in zip(
                update.request_ids, update.seq_indices.tolist(), update.token_ids.tolist(), update.finish_reasons, strict=True
            )
        ]
        done = {request_id: self._requests.pop(request_id) for request_id in update.finished_request_ids}
        return produced, done

    def _append(
        self, produced: list[_Produced], now: float, logprobs: dict[tuple[str, int], TokenLogprob]
    ) -> tuple[list[TokenEvent], dict[str, None], list[tuple[str, int]]]:
        """Appends the produced tokens (with their ``logprobs``, by (request id, sample index), and
        text) to their requests' outputs and histories, each under its request's lock, skipping a
        request an abort ended meanwhile. Returns the token events, the requests ended here (every
        sample met a stop string, or the tokenizer could not decode) and the samples a stop string
        ended, for :meth:`_settle`."""
        events = []
        ended: dict[str, None] = {}  # ended here, not by the scheduler
        stopped: list[tuple[str, int]] = []  # samples ended here by a stop string
        for request, request_id, index, token, reason in produced:
            with request.lock:
                if request.output.finished or request.output.outputs[index].finish_reason is not None:
                    continue  # aborted meanwhile, or its request failed this step
                logprob = logprobs.get((request_id, index))
                if request.params.logprobs:
                    assert logprob is not None and logprob.token_id == token, "every kept token has its sampled logprob"
                text = None if request.texts is None else request.texts[index]
                try:
                    completed = self._advance_grammar(request, index, token, reason)
                    event = append_token(request.output, text, index, token, reason or completed, logprob, now)
                except BaseException as error:  # noqa: BLE001 - whatever the tokenizer or grammar raises fails this request only
                    if isinstance(error, InvalidArgumentError):  # the grammar's: a token the mask allowed
                        request.output.error = f"its grammar refused token {token}: {error}"
                    else:
                        _log.error("the tokenizer raised %r decoding request %r", error, request_id, exc_info=error)
                        request.output.error = f"its tokens cannot be decoded: {error!r}"
                    for failed in request.output.outputs:
                        failed.finish_reason = "error"
                    ended[request_id] = None
                    continue
                if request.histories is not None:
                    request.histories[index].append(token)
                if reason is None and event.finish_reason is not None:  # a stop string the scheduler has not seen
                    stopped.append((request_id, index))
                    if all(c.finish_reason is not None for c in request.output.outputs):
                        ended[request_id] = None
                events.append(event)
        return events, ended, stopped

    @staticmethod
    def _advance_grammar(request: _Request, index: int, token: int, reason: str | None) -> str | None:
        """Advances sample ``index``'s matcher past ``token`` (not past a token the scheduler
        ended the sample with: nothing follows it); "stop" once the grammar has finished. Raises
        :class:`InvalidArgumentError` for a token the grammar refuses, changing nothing."""
        if request.matchers is None or reason is not None:
            return None
        matcher = request.matchers[index]
        matcher.advance(token)
        return "stop" if matcher.is_finished else None

    def _settle(self, ended: dict[str, None], stopped: list[tuple[str, int]]) -> dict[str, _Request]:
        """Under the lock: takes out of the scheduler what :meth:`_append` ended — a sample a stop
        string ended while siblings run (``finish_sample``), a request it ended whole (aborted
        there, popped here) — unless an abort took the request meanwhile. Returns those popped."""
        for request_id, index in stopped:
            if request_id not in ended and request_id in self._requests:
                self.scheduler.finish_sample(request_id, index)
        popped = {}
        for request_id in ended:
            if request_id in self._requests:  # not finished by the scheduler, nor aborted meanwhile
                self.scheduler.abort(request_id)
                popped[request_id] = self._requests.pop(request_id)
        return popped

    def _abandon(self, step: SchedulerOutput) -> None:
        """Completes the protocol of a step that could not run: aborts its requests, so that the
        update of placeholder tokens changes nothing else."""
        with self._lock:
            for request_id in dict.fromkeys(step.request_ids):
                if self._requests.pop(request_id, None) is not None:
                    self.scheduler.abort(request_id)
            self.scheduler.update(step, np.zeros(step.num_samples, dtype=np.int64))

    def _finish(self, output: RequestOutput, now: float | None = None) -> None:
        output.finished = True
        output.metrics.finished_time = self.clock() if now is None else now
        if self._tracer is not None:
            call_guarded(self._tracer.finished, output, what="tracer")

    def stats(self) -> dict[str, float]:
        """The scheduler's cumulative stats, current (they include every completed step), with
        the disk tier's (``disk_*``) when it has one, and the grammars' (``grammar_*``: compiles,
        their seconds, cache hits, rejected constraints; masked steps and rows, the masks' seconds
        computed (summed over rows) and the seconds steps waited for them)."""
        return self.scheduler.stats() | self.grammars.stats() | self._grammar_stats.snapshot()

    def kv_groups(self) -> list[KvGroup]:
        """The KV cache groups of the model's layout (``Scheduler.kv_groups``): what each keeps and
        the blocks it holds now; empty for a runner without K/V."""
        groups, blocks = self.scheduler.kv_groups, self.scheduler.kv_group_blocks
        return [KvGroup(group.layers, group.layer.window, held, group.block_size)
                for group, held in zip(groups, blocks, strict=False)]

    def kv_group_usage(self) -> list[float]:
        """The fraction of the pool each KV cache group holds now, in group order."""
        return [group.blocks_in_use / self.config.num_blocks for group in self.kv_groups()]

    def _record_kv_events(self) -> None:
        """Records the KV events the scheduler made since the last call (under the lock, so
        batch numbers follow the scheduler's order); the caller delivers them once it has
        released the lock."""
        if self._emit_kv_events:
            events = self.scheduler.take_kv_events()
            # A medium cleared is every group's.
            self.kv_events.record([e for e in events if type(e) is AllBlocksCleared or e.group == ROUTED_KV_GROUP])

    def kv_snapshot(self) -> KvSnapshot:
        """The blocks findable now, as ``(block_hash, medium)`` pairs, tagged with the number of
        the last event batch they include: a router that applied batches up to ``seq`` and then
        every later one holds the engine's blocks. Taken under the lock that records events,
        after recording those pending (delivered to subscribers once the lock is released)."""
        with self._lock:
            self._record_kv_events()
            blocks = self.scheduler.kv_blocks(ROUTED_KV_GROUP)
            snapshot = KvSnapshot(self.kv_events.last_seq, frozenset(blocks))
        self.kv_events.deliver()
        return snapshot

    def close(self) -> None:
        """Flushes and closes the disk tier, if any (its pending writes committed, its files
        released, so another engine may open the directory; with KV events, its blocks published
        as cleared). Steps after this run on RAM alone. Closing again does nothing."""
        with self._lock:
            if self._tier_attached:
                self._tier_attached = False
                last = self.scheduler.detach_disk_tier()  # the tier's last events, then its medium cleared
                if self._emit_kv_events:
                    self.kv_events.record([*self.scheduler.take_kv_events(), *last])
        self.kv_events.deliver()


def _scoring(
    step: SchedulerOutput, row_requests: Sequence[_Request | None]
) -> tuple[ScoreRows | None, list[tuple[_Request, np.ndarray]]]:
    """The token rows of ``step`` scoring a prompt token of a request that asked for prompt
    logprobs (``row_requests``: each sequence row's request, None if it ended meanwhile), and where
    their scores go: (request, prompt positions scored)."""
    wanted = [r if r is not None and r.params.prompt_logprobs is not None else None for r in row_requests]
    if not any(wanted):
        return None, []
    prompts = [None if r is None else r.output.prompt_token_ids for r in wanted]
    rows, targets, where = rows_of(np.asarray(step.positions), np.asarray(step.query_start_loc), prompts)
    if not len(rows):
        return None, []
    top = max(r.params.prompt_logprobs for r in wanted if r is not None)  # type: ignore[type-var]
    return ScoreRows(rows, targets, int(top)), [(wanted[i], positions) for i, positions in where]  # type: ignore[misc]


def _logprobs_by_sample(
    step: SchedulerOutput, requests: Sequence[_Request], samples: Samples | None
) -> dict[tuple[str, int], TokenLogprob]:
    """The :class:`TokenLogprob` of each sample row whose request asked for logprobs, by
    (request id, sample index): the update that accepts the tokens need not keep the rows' order."""
    out: dict[tuple[str, int], TokenLogprob] = {}
    if samples is None:
        return out
    for row, (request, request_id, index) in enumerate(
        zip(requests, step.sample_request_ids, step.sample_seq_indices.tolist(), strict=True)
    ):
        k = request.params.top_logprobs
        if request.params.logprobs:
            top = zip(samples.top_ids[row, :k].tolist(), samples.top_logprobs[row, :k].tolist(), strict=True)
            alternatives = tuple((t, lp) for t, lp in top if t >= 0)  # fewer than k: -1 pads the row
            out[(request_id, index)] = TokenLogprob(int(samples.tokens[row]), float(samples.logprobs[row]), alternatives)
    return out


def _vocabulary_tokens(prompt: Sequence[int], vocab_size: int) -> list[int]:
    """``prompt`` as a list of token ids of a ``vocab_size`` vocabulary (a sequence or 1-D array of
    integers; not a string, bytes or bools), or :class:`InvalidArgumentError`. The scheduler checks
    the rest (emptiness, length)."""
    if isinstance(prompt, (str, bytes, bytearray, memoryview)):
        raise InvalidArgumentError(f"prompt token ids must be a sequence of ints, not {type(prompt).__name__}")
    try:
        token_ids = [_token_id(t) for t in prompt]
    except TypeError as error:
        raise InvalidArgumentError(f"prompt token ids must be a sequence of ints: {error}") from None
    out_of_vocab = [t for t in token_ids if not 0 <= t < vocab_size]
    if out_of_vocab:
        raise InvalidArgumentError(f"prompt token ids {out_of_vocab[:5]} outside the vocabulary of {vocab_size}")
    return token_ids


def _token_id(value: object) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{value!r} is a bool, not a token id")
    return operator.index(value)  # type: ignore[arg-type]
