"""Serving workloads: trace requests turned into token-level requests every policy replays alike.

A :class:`ServingRequest` carries concrete prompt token ids (seeded pseudo-random, so two requests
share a prefix only when the workload says so), the number of tokens to generate, and its arrival
time. :func:`build_workload` makes them from trace lengths, with the trace's arrival times or
Poisson arrivals at a chosen rate, and optionally prepends one of a few shared system prompts
(the prefix-caching variant). :func:`ideal_prefill_tokens` is the prefill work an unbounded,
block-granular prefix cache would leave.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagedkv.errors import InvalidArgumentError
from pagedkv.traces import TraceRequest

__all__ = ["ServingRequest", "SystemPrompts", "Workload", "build_workload", "ideal_prefill_tokens"]


@dataclass(frozen=True)
class ServingRequest:
    """One request as a serving policy sees it."""

    request_id: str
    arrival_s: float
    prompt_token_ids: np.ndarray  # int64
    max_tokens: int  # generated exactly (end-of-sequence ignored)
    system_prompt: int | None = None  # index of the shared system prompt it starts with
    system_prompt_len: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class SystemPrompts:
    """How the prefix-caching variant shares prompts: ``count`` system prompts with lengths drawn
    uniformly from ``[min_len, max_len]``, one prepended to every request: chosen uniformly, or
    with ``skew`` > 0 by a Zipf law (prompt k with probability ∝ 1 / (k + 1) ** skew: a few
    popular tenants and a long tail, as a many-tenant service sees)."""

    count: int = 8
    min_len: int = 200
    max_len: int = 600
    skew: float = 0.0


@dataclass(frozen=True)
class Workload:
    """Requests in arrival order, and how they were made."""

    name: str
    requests: list[ServingRequest]
    truncated_prompts: int  # prompts shortened to fit max_model_len

    @property
    def offered_rate(self) -> float:
        """Requests per second over the arrival span (0 for a single instant)."""
        span = self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0
        return (len(self.requests) - 1) / span if span > 0 else 0.0


def build_workload(
    trace: Sequence[TraceRequest],
    *,
    max_model_len: int,
    rate: float | None = None,
    system_prompts: SystemPrompts | None = None,
    length_scale: float = 1.0,
    vocab: tuple[int, int] = (3, 32000),
    seed: int = 0,
) -> Workload:
    """Token-level requests from trace lengths.

    - ``rate``: None replays the trace's arrival times; a positive rate draws Poisson arrivals
      (exponential gaps) at that many requests per second; ``inf`` makes everything arrive at 0.
    - ``system_prompts``: prepend shared system prompts (the prefix-caching variant).
    - ``length_scale``: multiplies prompt, output and system-prompt lengths (for small models).
    - ``vocab``: token ids are drawn from ``[vocab[0], vocab[1])``.

    A prompt is cut (from its end) so that prompt + output fits ``max_model_len``; outputs longer
    than ``max_model_len // 2`` are cut to that first.
    """
    if rate is not None and not rate > 0:
        raise InvalidArgumentError(f"rate must be > 0 requests/s, got {rate!r}")
    if max_model_len < 2:
        raise InvalidArgumentError(f"max_model_len must be ≥ 2 (a prompt token and an output token), got {max_model_len}")
    arrival_rng, prompt_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    low, high = vocab
    if rate is None:
        arrivals = np.array([r.arrival_s for r in trace], dtype=np.float64)
    elif np.isinf(rate):
        arrivals = np.zeros(len(trace))
    else:
        gaps = arrival_rng.exponential(1.0 / rate, size=len(trace))
        arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])

    def scaled(n: int) -> int:
        return max(1, round(n * length_scale))

    shared: list[np.ndarray] = []
    popularity = None
    if system_prompts is not None:
        if not 0 <= system_prompts.skew < float("inf"):
            raise InvalidArgumentError(f"SystemPrompts.skew must be finite and ≥ 0, got {system_prompts.skew!r}")
        if system_prompts.skew > 0:
            weights = 1.0 / np.arange(1, system_prompts.count + 1) ** system_prompts.skew
            popularity = weights / weights.sum()
        lengths = prompt_rng.integers(system_prompts.min_len, system_prompts.max_len + 1, size=system_prompts.count)
        shared = [prompt_rng.integers(low, high, size=scaled(int(n)), dtype=np.int64) for n in lengths]

    requests = []
    truncated = 0
    for i, (entry, arrival) in enumerate(zip(trace, arrivals, strict=True)):
        request_rng = np.random.default_rng([seed, i])
        max_tokens = min(scaled(entry.output_tokens), max_model_len // 2)
        prefix_index = None
        if shared and popularity is None:
            prefix_index = int(request_rng.integers(len(shared)))
        elif shared:
            prefix_index = int(request_rng.choice(len(shared), p=popularity))
        prefix = shared[prefix_index] if prefix_index is not None else np.empty(0, dtype=np.int64)
        own = request_rng.integers(low, high, size=scaled(entry.prompt_tokens), dtype=np.int64)
        prompt = np.concatenate([prefix, own])
        room = max_model_len - max_tokens
        if len(prompt) > room:
            prompt = prompt[:room]
            truncated += 1
        requests.append(
            ServingRequest(
                request_id=f"r{i}",
                arrival_s=float(arrival),
                prompt_token_ids=prompt,
                max_tokens=max_tokens,
                system_prompt=prefix_index,
                system_prompt_len=min(len(prefix), len(prompt)),
            )
        )
    name = "shared-prefix" if shared else "trace"
    return Workload(name=name, requests=requests, truncated_prompts=truncated)


def ideal_prefill_tokens(requests: Sequence[ServingRequest], block_size: int) -> int:
    """Prompt tokens computed by an unbounded prefix cache that reuses whole blocks only.

    Each request reuses the full blocks of its system prompt if an earlier request carried the
    same one (its own tokens are unique), but never its last prompt token: the model needs that
    token's logits. Everything else is computed once.
    """
    seen: set[int] = set()
    total = 0
    for request in requests:
        cached = 0
        if request.system_prompt is not None:
            if request.system_prompt in seen:
                reusable = min(request.system_prompt_len, request.prompt_len - 1)
                cached = reusable // block_size * block_size
            seen.add(request.system_prompt)
        total += request.prompt_len - cached
    return total
