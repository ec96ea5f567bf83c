"""Model runners: what turns a scheduled step into one sampled token per sample row — a model on
the paged KV cache, or a simulated model on virtual time.

Invariants: a runner's ``run`` returns one row per ``step.logits_indices`` entry, drawn under that
row's parameters and generator; a simulated runner advances its clock by the modelled step time
and computes nothing. A runner declares what it keeps of K/V (``kv_spec``, None for none); the
scheduler owns that K/V and the runner's model reaches it only through each step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from pagedkv._core import KvSpec
from pagedkv.engine.constraints import StepMasks
from pagedkv.engine.prompt_scoring import ScoreRows, score
from pagedkv.models.simulated import SimulatedModel
from pagedkv.models.step import ModelStep
from pagedkv.sampling import Samples, SamplingParams, TokenHistory, sample_with_logprobs

__all__ = ["ModelRunner", "PagedModelRunner", "SimulatedRunner", "VirtualClock"]


class ModelRunner(Protocol):
    """Turns a scheduled step into one sampled token per sample row."""

    vocab_size: int
    max_model_len: int
    kv_spec: KvSpec | None
    scores_prompts: bool  # whether ``run`` takes ``scoring`` (a model with logits at every position)

    def run(
        self,
        step: ModelStep,
        params: Sequence[SamplingParams],
        generators: Sequence[np.random.Generator],
        histories: Sequence[TokenHistory | None],
        scoring: ScoreRows | None = None,
        masks: StepMasks | None = None,
    ) -> Samples:
        """The samples of ``step.logits_indices``: row r drawn under ``params[r]`` from
        ``generators[r]``, penalised by ``histories[r]`` (None: no penalty), with the logprobs
        ``params[r]`` asks for (:func:`~pagedkv.sampling.sample_with_logprobs`);
        :data:`~pagedkv.sampling.NO_TOKEN` for a row with nothing to draw from; with
        ``scoring``, the scores of those token rows (:attr:`Samples.prompt_scores`). ``masks``
        (given only when the step has constrained rows: a runner serving no structured outputs
        need not take it) are the grammar masks being computed: collected (``masks.wait()``)
        after the forward pass, applied when sampling."""
        ...


class VirtualClock:
    """A clock that only moves when told: simulated runs measure latency in modelled seconds."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class PagedModelRunner:
    """A model computing logits over paged K/V (e.g. :class:`pagedkv.LlamaModel`), stored as
    ``kv_dtype`` (None: the core's default)."""

    def __init__(self, model, kv_dtype: str | None = None) -> None:
        self.model = model
        self.kv_spec: KvSpec | None = model.kv_spec(kv_dtype)
        self.vocab_size = model.config.vocab_size
        self.max_model_len = model.config.max_position_embeddings
        self.scores_prompts = hasattr(model, "hidden")

    def run(
        self,
        step: ModelStep,
        params: Sequence[SamplingParams],
        generators: Sequence[np.random.Generator],
        histories: Sequence[TokenHistory | None],
        scoring: ScoreRows | None = None,
        masks: StepMasks | None = None,
    ) -> Samples:
        if scoring is None or not len(scoring.rows):
            logits = self.model.forward(step)  # the masks are computed on the pool meanwhile
            return sample_with_logprobs(logits, params, generators, histories, None if masks is None else masks.wait())
        sampled = np.asarray(step.logits_indices)
        hidden = self.model.hidden(step, np.concatenate([sampled, scoring.rows]))
        logits = self.model.logits(hidden[: len(sampled)])
        samples = sample_with_logprobs(logits, params, generators, histories, None if masks is None else masks.wait())
        return dataclasses.replace(samples, prompt_scores=score(hidden[len(sampled) :], scoring, self.model.logits))


class SimulatedRunner:
    """A :class:`SimulatedModel`: no arithmetic; each step advances ``clock`` by the modelled time."""

    def __init__(self, model: SimulatedModel, clock: VirtualClock, max_model_len: int = 1 << 20) -> None:
        self.model = model
        self.clock = clock
        self.kv_spec = None
        self.scores_prompts = False  # no logits
        self.vocab_size = model.vocab_size
        self.max_model_len = max_model_len

    def run(
        self,
        step: ModelStep,
        params: Sequence[SamplingParams],
        generators: Sequence[np.random.Generator],
        histories: Sequence[TokenHistory | None],
        scoring: ScoreRows | None = None,
        masks: StepMasks | None = None,
    ) -> Samples:
        """The simulated model's tokens, each certain (it has no logits: no penalty applies); a
        constrained row whose token its grammar does not allow takes the lowest one it does."""
        self.clock.advance(self.model.step_seconds(step))
        return Samples.certain(self.model.sample(step), params, None if masks is None else masks.wait())
