"""A stand-in for a model too large for the CPU: :class:`SimulatedModel`.

It does no arithmetic. For a step it reports how long a GPU would have taken, from a linear cost
model, and it picks tokens by hashing (position, input token, seed), so runs are reproducible and
independent of batching. The scheduler and KV cache run for real; only the model is simulated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedkv.errors import InvalidArgumentError
from pagedkv.models.step import StepArrays

__all__ = ["StepCostModel", "SimulatedModel"]


@dataclass(frozen=True)
class StepCostModel:
    """Step time ``seconds = fixed + per_token * tokens + per_context_token * sum(context_lens)``.

    The defaults resemble a 7B Llama in 16-bit on one A100-80GB class GPU:

    - ``fixed`` 8 ms: every step streams the 13.5 GB of weights at about 1.7 TB/s, plus launch
      overhead; this dominates small decode batches.
    - ``per_token`` 70 µs: about 14 GFLOP of matrix products per token at an effective
      200 TFLOP/s; this dominates prefill.
    - ``per_context_token`` 0.3 µs: attention reads 0.5 MiB of K/V per cached token
      (32 layers × K and V × 4096 × 2 bytes) at about 1.7 TB/s; this dominates long-context decode.
    """

    fixed: float = 8e-3
    per_token: float = 70e-6
    per_context_token: float = 0.3e-6

    def __post_init__(self) -> None:
        for name in ("fixed", "per_token", "per_context_token"):
            value = getattr(self, name)
            if not value >= 0:
                raise InvalidArgumentError(f"StepCostModel.{name} must be ≥ 0, got {value!r}")

    def step_seconds(self, num_tokens: int, total_context: int) -> float:
        """Modelled duration of a step of ``num_tokens`` tokens over ``total_context`` cached tokens."""
        return self.fixed + self.per_token * num_tokens + self.per_context_token * total_context


class SimulatedModel:
    """Reads the same :class:`~pagedkv.models.step.StepArrays` as the real model, but returns a
    modelled step time and pseudo-random tokens instead of logits.

    Tokens lie in ``[first_token_id, vocab_size)`` and are never one of ``stop_token_ids``, except
    that with ``stop_probability`` > 0 a sampled row becomes ``stop_token_ids[0]`` with that
    probability (so requests can end before ``max_tokens``).
    """

    def __init__(
        self,
        vocab_size: int = 32000,
        cost: StepCostModel | None = None,
        stop_token_ids: tuple[int, ...] = (2,),
        stop_probability: float = 0.0,
        first_token_id: int = 3,
        seed: int = 0,
    ) -> None:
        if not 0 <= first_token_id < vocab_size:
            raise InvalidArgumentError(f"first_token_id {first_token_id} must lie in [0, vocab_size={vocab_size})")
        if not 0.0 <= stop_probability <= 1.0:
            raise InvalidArgumentError(f"stop_probability must be in [0, 1], got {stop_probability!r}")
        if stop_probability > 0 and not stop_token_ids:
            raise InvalidArgumentError("stop_probability > 0 needs a stop token id")
        self._allowed = np.setdiff1d(np.arange(first_token_id, vocab_size), stop_token_ids)
        if self._allowed.size == 0:
            raise InvalidArgumentError("no token id is left to sample once the stop tokens are excluded")
        self.vocab_size = vocab_size
        self.cost = cost or StepCostModel()
        self.stop_token_ids = tuple(stop_token_ids)
        self.stop_probability = stop_probability
        self.seed = seed

    def step_seconds(self, step: StepArrays) -> float:
        """Modelled duration of ``step`` (reads ``input_ids`` and ``context_lens``)."""
        return self.cost.step_seconds(len(step.input_ids), int(np.sum(step.context_lens, dtype=np.int64)))

    def sample(self, step: StepArrays) -> np.ndarray:
        """One token per ``step.logits_indices`` row (int64), a hash of that row's position, input
        token and the model's seed (reads ``logits_indices``, ``positions``, ``input_ids``)."""
        rows = np.asarray(step.logits_indices)
        h1 = _mix(np.asarray(step.positions, dtype=np.uint64)[rows] ^ np.uint64(self.seed))
        h2 = _mix(h1 ^ np.asarray(step.input_ids, dtype=np.uint64)[rows])
        tokens = self._allowed[(h2 % np.uint64(self._allowed.size)).astype(np.int64)]
        if self.stop_probability > 0:
            uniform = (_mix(h2) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
            tokens = np.where(uniform < self.stop_probability, self.stop_token_ids[0], tokens)
        return tokens.astype(np.int64)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 arrays: a cheap bijective hash with good avalanche."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))
