"""The Gemma 3 text decoder on the paged KV cache: :class:`Gemma3Config` and :class:`Gemma3Model`.

What sets it apart from Llama (each checked against transformers' ``modeling_gemma3`` and
llama.cpp's ``gemma3`` graph):

- layers alternate **sliding-window** (local) and full (global) attention: every
  ``sliding_window_pattern``-th layer is global, the others attend over the last
  ``sliding_window`` tokens (the query's own included). The model declares each layer's window in
  its :meth:`Gemma3Model.kv_spec`; the step applies it (the model never passes it per call);
- local layers rotate with base ``rope_local_theta`` (10,000), global ones with ``rope_theta``
  (1,000,000; a GGUF file stores only this one), rescaled linearly by ``rope_scaling_factor``;
- RMSNorm on each head's query and key before the rotation, and norms before *and after* both
  the attention and the MLP; every norm multiplies by ``1 + weight``;
- a GELU (tanh approximation) gated MLP; embeddings scaled by ``√hidden_size`` and tied to the
  output; attention scaled by ``query_pre_attn_scalar ** -0.5``.

Invariants: as :class:`~pagedkv.models.llama.LlamaModel` — construction streams (a layer is packed
once its tensors have arrived), positions come from the step, and the K/V of layer ``i`` is
reached only through the step. Norm weights are kept as the multipliers ``1 + weight``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pagedkv._core import Decoder, DecoderLayer, Embedding, KvSpec, LayerSpec, Linear
from pagedkv.errors import InvalidArgumentError
from pagedkv.models.decoder import PagedDecoder
from pagedkv.models.layers import Tensor, embedding_of, float_tensor, fused_linear, packed_linear
from pagedkv.models.rope import inverse_frequencies

__all__ = ["Gemma3Config", "Gemma3Model", "GEMMA3_LAYER_TENSORS"]


@dataclass(frozen=True)
class Gemma3Config:
    """Dimensions and constants of a Gemma 3 text decoder (see the module doc)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int
    sliding_window_pattern: int = 6
    rope_theta: float = 1_000_000.0
    rope_local_theta: float = 10_000.0
    rope_scaling_factor: float = 1.0
    query_pre_attn_scalar: float = 256.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    bos_token_id: int | None = 2
    eos_token_ids: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "sliding_window", "sliding_window_pattern", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgumentError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise InvalidArgumentError(f"head_dim must be even for rotary embedding, got {self.head_dim}")
        for name in ("rope_theta", "rope_local_theta", "rope_scaling_factor", "query_pre_attn_scalar", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
                raise InvalidArgumentError(f"{name} must be a positive number, got {value!r}")
        special = [self.bos_token_id, *self.eos_token_ids]
        if any(t is not None and not (isinstance(t, int) and 0 <= t < self.vocab_size) for t in special):
            raise InvalidArgumentError(f"special token ids {special} must be integers in [0, {self.vocab_size})")

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends over a window (every ``sliding_window_pattern``-th is global)."""
        return (layer + 1) % self.sliding_window_pattern != 0

    def replace(self, **changes: object) -> Gemma3Config:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def kv_spec(self, dtype: str | None = None) -> KvSpec:
        """Each layer's K/V: ``num_kv_heads`` heads of ``head_dim`` (one of 256 for the 270M model),
        local layers over the last ``sliding_window`` tokens, global ones over all."""
        layers = [LayerSpec(self.num_kv_heads, self.head_dim, self.sliding_window if self.is_sliding(i) else None)
                  for i in range(self.num_layers)]
        return KvSpec(layers) if dtype is None else KvSpec(layers, dtype)


# Field of a packed layer's parts -> Hugging Face tensor name inside ``model.layers.{i}.``
GEMMA3_LAYER_TENSORS = {
    "input_layernorm": "input_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "o_proj": "self_attn.o_proj.weight",
    "post_attention_layernorm": "post_attention_layernorm.weight",
    "pre_feedforward_layernorm": "pre_feedforward_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
    "post_feedforward_layernorm": "post_feedforward_layernorm.weight",
}
_LAYER_FIELDS = {suffix: field for field, suffix in GEMMA3_LAYER_TENSORS.items()}
_NORMS = frozenset(field for field in GEMMA3_LAYER_TENSORS if field.endswith("norm"))


def expected_gemma3_shape(c: Gemma3Config, name: str) -> tuple[int, ...] | None:
    """The shape ``c`` implies for the Hugging Face tensor ``name``; None when the model has none."""
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    if name.startswith("model.layers."):
        index, _, suffix = name[len("model.layers."):].partition(".")
        if not (index.isascii() and index.isdigit() and len(index) < 10 and int(index) < c.num_layers):
            return None
        field = _LAYER_FIELDS.get(suffix)
        shapes = {
            "q_proj": (q_dim, c.hidden_size), "k_proj": (kv_dim, c.hidden_size), "v_proj": (kv_dim, c.hidden_size),
            "q_norm": (c.head_dim,), "k_norm": (c.head_dim,), "o_proj": (c.hidden_size, q_dim),
            "gate_proj": (c.intermediate_size, c.hidden_size), "up_proj": (c.intermediate_size, c.hidden_size),
            "down_proj": (c.hidden_size, c.intermediate_size),
        }
        return None if field is None else shapes.get(field, (c.hidden_size,))
    return {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}.get(name)


class Gemma3Model(PagedDecoder):
    """A Gemma 3 decoder running on paged K/V, reached through each step (:class:`ModelStep`).

    Projections are packed as :class:`~pagedkv._core.Linear` of ``weight_dtype``, ``[q|k|v]`` and
    ``[gate|up]`` fused; the output projection is the embedding table's (tied). The embedding
    table stays float32 for the gather, or, kept quantized ("auto"), is the output projection's
    own rows dequantized on gather."""

    def __init__(self, config: Gemma3Config, tensors: Iterable[tuple[str, Tensor]], *,
                 weight_dtype: str = "float32") -> None:
        """A model from Hugging Face-named float32 tensors (norm weights as transformers holds
        them: the multiplier is ``1 + weight``), consumed one at a time. Raises
        :class:`InvalidArgumentError` when a tensor is missing, unknown or misshapen."""
        super().__init__(config, weight_dtype)
        self._pack(tensors)

    @classmethod
    def from_tensors(cls, config: Gemma3Config, tensors: Iterable[tuple[str, Tensor]], *,
                     weight_dtype: str = "float32") -> Gemma3Model:
        """The model of ``config`` from streamed tensors (the loaders' entry point)."""
        return cls(config, tensors, weight_dtype=weight_dtype)

    def _pack(self, tensors: Iterable[tuple[str, Tensor]]) -> None:
        c = self.config
        pending: dict[int, dict[str, Tensor]] = {}
        layers: dict[int, _Gemma3Layer] = {}
        found: dict[str, Tensor] = {}
        embedding: Embedding | None = None
        for name, array in tensors:
            expected = expected_gemma3_shape(c, name)
            if expected is None:
                raise InvalidArgumentError(f"tensor {name} is not part of this model")
            if array.shape != expected:
                raise InvalidArgumentError(f"tensor {name} has shape {array.shape}, expected {expected}")
            index, _, suffix = name.removeprefix("model.layers.").partition(".")
            if name.startswith("model.layers."):
                parts = pending.setdefault(int(index), {})
                parts[_LAYER_FIELDS[suffix]] = array
                if len(parts) == len(_LAYER_FIELDS):
                    layers[int(index)] = _pack_layer(pending.pop(int(index)), self.weight_dtype, int(index))
            elif name == "model.embed_tokens.weight":  # the output projection too (tied)
                self._lm_head = packed_linear(array, self.weight_dtype, name)
                embedding, self._embedding_nbytes = embedding_of(array, self._lm_head)
            else:
                found[name] = array
            del array  # the loop must not keep the last tensor alive while the next is read
        missing = [f"model.layers.{i}" for i in range(c.num_layers) if i not in layers]
        missing += ["model.embed_tokens.weight"] if embedding is None else []
        missing += [n for n in ("model.norm.weight",) if n not in found]
        if embedding is None or missing:
            raise InvalidArgumentError(f"tensors missing: {', '.join(missing)}")
        self._final_norm = _multiplier(float_tensor(found["model.norm.weight"], "model.norm.weight"))
        self._layers = [layers[i] for i in range(c.num_layers)]
        # Local layers rotate with the local base; global ones with rope_theta, rescaled linearly.
        rotations = [inverse_frequencies(c.rope_theta, c.head_dim) / c.rope_scaling_factor,
                     inverse_frequencies(c.rope_local_theta, c.head_dim)]
        self._decoder = Decoder(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
            activation="gelu_tanh", attention_scale=float(c.query_pre_attn_scalar) ** -0.5,
            embedding_scale=float(np.float32(math.sqrt(c.hidden_size))), max_positions=c.max_position_embeddings,
            rope_frequencies=rotations, embedding=embedding,
            layers=[DecoderLayer(input_norm=layer.input_layernorm, qkv=layer.qkv, q_norm=layer.q_norm,
                                 k_norm=layer.k_norm, o=layer.o, post_attention_norm=layer.post_attention_layernorm,
                                 pre_mlp_norm=layer.pre_feedforward_layernorm, gate_up=layer.gate_up, down=layer.down,
                                 post_mlp_norm=layer.post_feedforward_layernorm, rope=int(c.is_sliding(index)))
                    for index, layer in enumerate(self._layers)],
            final_norm=self._final_norm, lm_head=self._lm_head,
        )

    @property
    def nbytes(self) -> int:
        """Bytes of every parameter as held: the packed projections, the output projection, the
        embedding table (float32, or the output projection's own quantized rows) and norms."""
        norms = [self._final_norm, *(getattr(layer, n) for layer in self._layers for n in _NORMS)]
        return self._embedding_nbytes + sum(a.nbytes for a in norms) + self.projection_nbytes

    def linears(self) -> list[Linear]:
        """Every projection a decode step multiplies by, the lm_head included."""
        return [self._lm_head, *(w for layer in self._layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down))]

    def kv_spec(self, dtype: str | None = None) -> KvSpec:
        """The config's (:meth:`Gemma3Config.kv_spec`): in pages of 16 tokens of 3 layers, its
        layout is one full group of 3 layers and three sliding ones — two of 6 layers in blocks of
        8 tokens, one of 3 in blocks of 16 (``Scheduler.kv_groups``)."""
        return self.config.kv_spec(dtype)


class _Gemma3Layer(NamedTuple):
    """One layer's weights in the forward pass's layout (norms as multipliers)."""

    input_layernorm: np.ndarray
    qkv: Linear
    q_norm: np.ndarray
    k_norm: np.ndarray
    o: Linear
    post_attention_layernorm: np.ndarray
    pre_feedforward_layernorm: np.ndarray
    gate_up: Linear
    down: Linear
    post_feedforward_layernorm: np.ndarray


def _pack_layer(parts: dict[str, Tensor], weight_dtype: str, index: int) -> _Gemma3Layer:
    layer = f"model.layers.{index}"
    return _Gemma3Layer(
        qkv=fused_linear([parts["q_proj"], parts["k_proj"], parts["v_proj"]], weight_dtype, f"{layer}.qkv"),
        o=packed_linear(parts["o_proj"], weight_dtype, f"{layer}.o_proj"),
        gate_up=fused_linear([parts["gate_proj"], parts["up_proj"]], weight_dtype, f"{layer}.gate_up"),
        down=packed_linear(parts["down_proj"], weight_dtype, f"{layer}.down_proj"),
        **{name: _multiplier(float_tensor(parts[name], f"{layer}.{name}")) for name in _NORMS},
    )


def _multiplier(weight: np.ndarray) -> np.ndarray:
    """What a Gemma norm multiplies by: ``1 + weight``, in float32 (as transformers computes it)."""
    return (np.float32(1.0) + weight.astype(np.float32)).astype(np.float32)
