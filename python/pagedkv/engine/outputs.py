"""What an engine reports for each request: its outputs (one per sample), the tokens streamed as
they are made, and the request's timings.

Invariants: a :class:`CompletionOutput` with ``logprobs`` has one entry per token of ``token_ids``;
:class:`RequestMetrics` times are the engine clock's seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CompletionOutput", "RequestMetrics", "RequestOutput", "TokenEvent", "TokenLogprob"]


@dataclass
class RequestMetrics:
    """Timestamps of one request (seconds of the engine's clock) and what they imply."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_time is None or self.finished_time is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        """Arrival to last token."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model's raw logits (before penalties,
    temperature and filters), and ``top``: the request's ``top_logprobs`` most likely tokens as
    ``(token_id, logprob)``, most likely first (empty when it asked for none)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class CompletionOutput:
    """One sample of a request. ``finish_reason``: None while it runs, else "stop", "length",
    "max_model_len", "abort", or "error" (its request failed: see :attr:`RequestOutput.error`).
    ``logprobs``: None unless the request asked for them, else one entry per token of
    ``token_ids``."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    """A request's prompt and samples so far (all of them once ``finished``). ``error`` says why
    a request failed (its samples then end with ``finish_reason == "error"``), None otherwise."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    prompt: str | None = None
    finished: bool = False
    error: str | None = None
    # Prompt tokens served from the prefix cache at its first admission (OpenAI's
    # usage.prompt_tokens_details.cached_tokens); 0 until then.
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # before it to predict it) and for any not computed yet.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def text(self) -> str:
        """Text of the first sample."""
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        """Tokens of the first sample."""
        return self.outputs[0].token_ids


@dataclass(frozen=True)
class TokenEvent:
    """One token produced by a step, for streaming; ``text`` is the text it adds to its sample
    (empty without a tokenizer, and while a character or a possible stop string is incomplete);
    ``logprob``: the token's, when its request asked for logprobs."""

    request_id: str
    index: int
    token_id: int
    finish_reason: str | None
    text: str = ""
    logprob: TokenLogprob | None = None
