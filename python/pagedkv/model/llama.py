"""The Llama forward pass on the paged KV cache: :class:`LlamaModel`.

One call runs one scheduler step, any mix of prefill chunks and decode tokens: each token's K/V
is written into the cache at its slot, and attention reads every sequence's context through its
block table with ``KVCache.attention`` (the Rust paged kernel). Positions come from the step, so
chunked prefill, prefix-cache hits and recompute after preemption need nothing special here; the
rotary angles are computed for those positions only (no table over ``max_position_embeddings``).
Matrix products run on the whole batch in the Rust linear kernel (``pagedkv._core.Linear``: weights
stored in float32, float16 or bfloat16, activations and sums in float32) on the same worker pool
as attention, so the two never compete for cores; there is no per-token Python loop.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import numpy as np
from threadpoolctl import ThreadpoolController

from pagedkv._core import KVCache, Linear
from pagedkv.errors import InvalidArgumentError, ShapeError
from pagedkv.model.rope import apply_rope, rope_cos_sin, rope_frequencies
from pagedkv.model.step import ModelStep
from pagedkv.model.weights import LlamaWeights

__all__ = ["LlamaModel", "rms_norm"]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last axis, in float32."""
    mean_square = np.mean(np.square(x), axis=-1, keepdims=True)
    return x * (1.0 / np.sqrt(mean_square + np.float32(eps))) * weight


class LlamaModel:
    """A Llama decoder running on a paged :class:`~pagedkv.KVCache`.

    The projections are packed fused (``[q|k|v]`` and ``[gate|up]``) into
    :class:`~pagedkv._core.Linear` weights of ``weight_dtype`` ("float32", "float16" or
    "bfloat16"), so each layer makes four matrix products, plus the lm_head's. The 16-bit dtypes
    halve the bytes a decode step streams; the embedding table stays float32 (it is gathered,
    not multiplied).

    ``blas_threads`` caps numpy's BLAS threads while :meth:`forward` runs (None leaves BLAS as it
    is), for whatever numpy still does there. The default, 1, is deliberate: the Rust workers need
    the same cores, and OpenBLAS threads that spin waiting for work starve everything else. On 2
    loaded cores, a batch-32 decode step of the tiny model took 14 ms with one BLAS thread and
    166 ms with two when numpy did the matrix products. The cap is process-wide while it holds,
    so numpy work on other threads during a step runs single-threaded too.
    """

    def __init__(self, weights: LlamaWeights, blas_threads: int | None = 1, weight_dtype: str = "float32") -> None:
        if blas_threads is not None and blas_threads < 1:
            raise InvalidArgumentError(f"blas_threads must be ≥ 1 or None, got {blas_threads}")
        self._blas_threads = blas_threads
        self._blas = ThreadpoolController() if blas_threads is not None else None
        self.config = weights.config
        c = self.config
        self._q_dim = c.num_heads * c.head_dim
        self._kv_dim = c.num_kv_heads * c.head_dim
        self._scale = float(c.head_dim) ** -0.5
        self._embed = weights.embed_tokens
        # `.T` of an `[out, in]` matrix is Fortran-ordered: Linear packs it without a copy.
        self._lm_head = Linear(weights.lm_head.T, weight_dtype)
        self.weight_dtype = self._lm_head.dtype
        self._final_norm = weights.norm
        self._layers = [
            _FusedLayer(
                input_norm=layer.input_layernorm,
                qkv=Linear(np.concatenate((layer.q_proj, layer.k_proj, layer.v_proj)).T, weight_dtype),
                o=Linear(layer.o_proj.T, weight_dtype),
                post_norm=layer.post_attention_layernorm,
                gate_up=Linear(np.concatenate((layer.gate_proj, layer.up_proj)).T, weight_dtype),
                down=Linear(layer.down_proj.T, weight_dtype),
            )
            for layer in weights.layers
        ]
        self._rope_frequencies = rope_frequencies(c)

    def new_kv_cache(self, num_blocks: int, block_size: int = 16, dtype: str = "float32") -> KVCache:
        """A KV cache shaped for this model (one K and V buffer per layer)."""
        c = self.config
        return KVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, dtype)

    def forward(self, step: ModelStep, kv_cache: KVCache) -> np.ndarray:
        """Runs one step: applies ``step.copy_ops`` to the cache, writes every token's K/V at
        ``step.slot_mapping``, attends through ``step.block_tables`` and returns the float32
        logits ``[len(step.logits_indices), vocab_size]`` of the rows ``step.logits_indices``."""
        with self._blas_limit():
            return self._forward(step, kv_cache)

    def _blas_limit(self) -> contextlib.AbstractContextManager[object]:
        if self._blas is None:
            return contextlib.nullcontext()
        return self._blas.limit(limits=self._blas_threads, user_api="blas")

    def _forward(self, step: ModelStep, kv_cache: KVCache) -> np.ndarray:
        c = self.config
        input_ids = np.asarray(step.input_ids)
        positions = np.asarray(step.positions)
        num_tokens = input_ids.shape[0]
        if input_ids.ndim != 1 or positions.shape != (num_tokens,):
            raise ShapeError(f"input_ids {input_ids.shape} and positions {positions.shape} must be equal 1-D shapes")
        if num_tokens and int(positions.max()) >= c.max_position_embeddings:
            raise InvalidArgumentError(
                f"position {int(positions.max())} is past max_position_embeddings {c.max_position_embeddings}"
            )
        copy_ops = [(int(src), int(dst)) for src, dst in step.copy_ops]
        if copy_ops:
            kv_cache.copy_blocks(copy_ops)

        cos, sin = rope_cos_sin(self._rope_frequencies, positions)
        hidden = self._embed[input_ids]
        for index, layer in enumerate(self._layers):
            x = rms_norm(hidden, layer.input_norm, c.rms_norm_eps)
            qkv = layer.qkv(x)
            q = qkv[:, : self._q_dim].reshape(num_tokens, c.num_heads, c.head_dim)
            k = qkv[:, self._q_dim : self._q_dim + self._kv_dim].reshape(num_tokens, c.num_kv_heads, c.head_dim)
            v = np.ascontiguousarray(qkv[:, self._q_dim + self._kv_dim :]).reshape(num_tokens, c.num_kv_heads, c.head_dim)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            kv_cache.write(index, k, v, step.slot_mapping)
            attn = kv_cache.attention(
                index, q, step.block_tables, step.context_lens, step.query_start_loc, scale=self._scale
            )
            hidden = hidden + layer.o(attn.reshape(num_tokens, self._q_dim))
            x = rms_norm(hidden, layer.post_norm, c.rms_norm_eps)
            gate_up = layer.gate_up(x)
            gate, up = gate_up[:, : c.intermediate_size], gate_up[:, c.intermediate_size :]
            hidden = hidden + layer.down(_silu(gate) * up)
        last = rms_norm(hidden[np.asarray(step.logits_indices)], self._final_norm, c.rms_norm_eps)
        return self._lm_head(last)


class _FusedLayer(NamedTuple):
    """One layer's weights in the forward pass's layout."""

    input_norm: np.ndarray
    qkv: Linear
    o: Linear
    post_norm: np.ndarray
    gate_up: Linear
    down: Linear


def _silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)`` in float32, written with tanh so no input overflows."""
    return x * (np.float32(0.5) + np.float32(0.5) * np.tanh(np.float32(0.5) * x))
