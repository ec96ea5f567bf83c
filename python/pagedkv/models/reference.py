"""A dense reference of the Llama forward pass: :class:`DenseReference`, the oracle of the tests.

No KV cache and no batching: every call recomputes the whole sequence in float64 with a dense
causal mask. It is written independently of :mod:`pagedkv.models.llama` (rotary embedding as a
complex rotation, K/V heads repeated for grouped-query attention) so that the two agree only if
both are right. Both take the rotary frequencies from :func:`pagedkv.models.rope.rope_frequencies`,
which the tests check on their own against the formulas.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagedkv.errors import InvalidArgumentError
from pagedkv.models.rope import rope_frequencies
from pagedkv.models.weights import LlamaWeights

__all__ = ["DenseReference"]


class DenseReference:
    """Full-recompute forward and greedy generation of one sequence, in float64."""

    def __init__(self, weights: LlamaWeights) -> None:
        self.weights = weights
        self.config = weights.config

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float64 logits ``[len(token_ids), vocab_size]``: row ``i`` predicts token ``i + 1``."""
        c, w = self.config, self.weights
        tokens = np.asarray(token_ids, dtype=np.int64)
        n = len(tokens)
        if n == 0 or n > c.max_position_embeddings:
            raise InvalidArgumentError(f"need 1..{c.max_position_embeddings} tokens, got {n}")
        rotation = self._rotation(n)
        causal = np.tril(np.ones((n, n), dtype=bool))
        h = w.embed_tokens[tokens].astype(np.float64)
        for layer in w.layers:
            x = self._norm(h, layer.input_layernorm)
            q = (x @ layer.q_proj.T.astype(np.float64)).reshape(n, c.num_heads, c.head_dim)
            k = (x @ layer.k_proj.T.astype(np.float64)).reshape(n, c.num_kv_heads, c.head_dim)
            v = (x @ layer.v_proj.T.astype(np.float64)).reshape(n, c.num_kv_heads, c.head_dim)
            q, k = self._rotate(q, rotation), self._rotate(k, rotation)
            k = np.repeat(k, c.num_queries_per_kv, axis=1)  # head h reads K/V head h // group
            v = np.repeat(v, c.num_queries_per_kv, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(c.head_dim)
            scores = np.where(causal, scores, -np.inf)
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            attended = np.einsum("hqk,khd->qhd", probs, v).reshape(n, c.num_heads * c.head_dim)
            h = h + attended @ layer.o_proj.T.astype(np.float64)
            x = self._norm(h, layer.post_attention_layernorm)
            gate = x @ layer.gate_proj.T.astype(np.float64)
            up = x @ layer.up_proj.T.astype(np.float64)
            h = h + (gate / (1.0 + np.exp(-gate)) * up) @ layer.down_proj.T.astype(np.float64)
        return self._norm(h, w.norm) @ w.lm_head.T.astype(np.float64)

    def generate_greedy(self, prompt: Sequence[int], max_tokens: int, stop_token_ids: Sequence[int] = ()) -> list[int]:
        """Greedy continuation of ``prompt``: up to ``max_tokens`` tokens, ending early after a
        token of ``stop_token_ids`` (which is included). Recomputes the whole sequence per token."""
        tokens = list(prompt)
        generated: list[int] = []
        for _ in range(max_tokens):
            token = int(np.argmax(self.logits(tokens)[-1]))
            generated.append(token)
            tokens.append(token)
            if token in stop_token_ids:
                break
        return generated

    def _norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        rms = np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.config.rms_norm_eps)
        return x / rms * weight.astype(np.float64)

    def _rotation(self, n: int) -> np.ndarray:
        """``exp(i * position * frequency)``, complex ``[n, head_dim // 2]``."""
        frequencies = rope_frequencies(self.config)
        return np.exp(1j * np.arange(n, dtype=np.float64)[:, None] * frequencies[None, :])

    @staticmethod
    def _rotate(x: np.ndarray, rotation: np.ndarray) -> np.ndarray:
        """Rotates element pairs ``(i, i + head_dim/2)`` of ``x`` ``[n, heads, head_dim]``,
        viewed as complex numbers, by ``rotation``."""
        half = x.shape[-1] // 2
        turned = (x[..., :half] + 1j * x[..., half:]) * rotation[:, None, :]
        return np.concatenate((turned.real, turned.imag), axis=-1)
