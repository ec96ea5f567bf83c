"""The Llama decoder on the paged KV cache: :class:`LlamaModel`.

One call runs one scheduler step, any mix of prefill chunks and decode tokens, wholly in the core
(:class:`pagedkv._core.Decoder`): each token's K/V is written at its slot and attention reads every
sequence's context through its block table, each through the step
(:class:`~pagedkv.models.step.ModelStep`). Positions come from the step, so chunked prefill,
prefix-cache hits and recompute after preemption need nothing special here; the rotary angles are
computed for those positions only (no table over ``max_position_embeddings``). Matrix products run
on the whole batch in the Rust linear kernel (``pagedkv._core.Linear``: weights stored in float32,
float16 or bfloat16 or kept quantized, activations and sums in float32) on the same worker pool
as attention; there is no per-token or per-layer Python loop.

Construction streams: :meth:`LlamaModel.from_tensors` packs each layer's projections into their
``Linear`` as soon as the layer's tensors have arrived and then drops the float32 arrays, so a
loader that yields one tensor at a time (``load_model``) never holds more than the packed model,
the float32 embedding table and one layer in float32.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from pagedkv._core import Decoder, DecoderLayer, Embedding, KvSpec, LayerSpec, Linear
from pagedkv.errors import InvalidArgumentError
from pagedkv.models.config import LlamaConfig
from pagedkv.models.decoder import PagedDecoder
from pagedkv.models.layers import Tensor, embedding_of, float_tensor, fused_linear, packed_linear
from pagedkv.models.rope import rope_frequencies
from pagedkv.models.weights import LAYER_TENSORS, LlamaWeights

__all__ = ["LlamaModel", "DEFAULT_WEIGHT_DTYPE", "WEIGHT_DTYPES"]

WEIGHT_DTYPES = ("float32", "float16", "bfloat16", "auto")
"""The storage types :class:`LlamaModel` packs its projections in; "auto" keeps a GGUF file's
quantized projections as shipped (:func:`~pagedkv.models.layers.fused_linear`)."""

# float16 is the default, measured on SmolLM2-135M (2-core AVX2 machine, load average 10-12, so
# the ratios within one run are what count): it halves the bytes a decode step streams as
# bfloat16 does, and single-request decode ran 1.66-1.72x float32's tokens/s (bfloat16
# 1.67-1.90x); but its 11-bit mantissa keeps transformers' greedy tokens on every golden prompt
# (tests/models/test_parity.py passes on it: logits within 0.034 of float32's), where bfloat16's 8 bits
# moved logits by up to 0.26 and flipped 3 of 256 teacher-forced tokens (all at top-1 margins
# below 0.04). A weight beyond float16's range is refused at load (bfloat16 or float32 then).
DEFAULT_WEIGHT_DTYPE = "float16"

# Hugging Face tensor suffix inside ``model.layers.{i}.`` -> LayerWeights field.
_LAYER_FIELDS = {suffix: field for field, suffix in LAYER_TENSORS.items()}


class LlamaModel(PagedDecoder):
    """A Llama decoder running on paged K/V, reached through each step (:class:`ModelStep`).

    The projections are packed fused (``[q|k|v]`` and ``[gate|up]``) into
    :class:`~pagedkv._core.Linear` weights of ``weight_dtype`` ("float32", "float16" or
    "bfloat16"), so each layer makes four matrix products, plus the lm_head's. The 16-bit dtypes
    halve the bytes a decode step streams; the embedding table stays float32 (it is gathered,
    not multiplied). Built here from float32 arrays, the default is float32: the tensors exactly as
    given (what tests against the dense reference need); the loaders (``load_model``,
    ``Engine.from_pretrained``, the CLI) default to :data:`DEFAULT_WEIGHT_DTYPE`.
    """

    def __init__(self, weights: LlamaWeights, weight_dtype: str = "float32") -> None:
        PagedDecoder.__init__(self, weights.config, weight_dtype)
        self._pack(weights.named_tensors())

    @classmethod
    def from_tensors(
        cls,
        config: LlamaConfig,
        tensors: Iterable[tuple[str, Tensor]],
        *,
        weight_dtype: str = "float32",
    ) -> LlamaModel:
        """A model from Hugging Face-named float32 tensors of the shapes ``config`` implies
        (``LlamaWeights.named_tensors``' names, in any order), consumed one at a time: a layer is
        packed once its nine tensors have arrived, and the arrays are not kept. Raises
        :class:`InvalidArgumentError` when a tensor is missing or unknown."""
        model = cls.__new__(cls)
        PagedDecoder.__init__(model, config, weight_dtype)
        model._pack(tensors)
        return model

    def _pack(self, tensors: Iterable[tuple[str, Tensor]]) -> None:
        c, weight_dtype = self.config, self.weight_dtype
        pending: dict[int, dict[str, Tensor]] = {}
        layers: dict[int, _FusedLayer] = {}
        found: dict[str, Tensor] = {}
        lm_head: Linear | None = None
        embedding: Embedding | None = None
        tied = c.tie_word_embeddings
        for name, array in tensors:
            index, _, suffix = name.removeprefix("model.layers.").partition(".")
            if name.startswith("model.layers.") and suffix in _LAYER_FIELDS and index.isdigit() and int(index) < c.num_layers:
                parts = pending.setdefault(int(index), {})
                parts[_LAYER_FIELDS[suffix]] = array
                if len(parts) == len(_LAYER_FIELDS):
                    layers[int(index)] = _fuse(pending.pop(int(index)), weight_dtype, int(index))
            elif name == "model.norm.weight":
                found[name] = array
            elif name != "model.embed_tokens.weight" and (name != "lm_head.weight" or tied):
                raise InvalidArgumentError(f"tensor {name} is not part of this model")
            if name == ("model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"):
                lm_head = packed_linear(array, weight_dtype, name)
            if name == "model.embed_tokens.weight":
                embedding, self._embedding_nbytes = embedding_of(array, lm_head if c.tie_word_embeddings else None)
            del array  # the loop must not keep the last tensor alive while the next is read
        missing = [f"model.layers.{i}" for i in range(c.num_layers) if i not in layers]
        missing += ["model.embed_tokens.weight"] if embedding is None else []
        missing += [n for n in ("model.norm.weight",) if n not in found]
        if lm_head is None or embedding is None or missing:
            raise InvalidArgumentError(f"tensors missing: {', '.join(missing or ['lm_head.weight'])}")
        self._final_norm = float_tensor(found["model.norm.weight"], "model.norm.weight")
        self._lm_head = lm_head
        self._layers = [layers[i] for i in range(c.num_layers)]
        self._decoder = Decoder(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
            activation="silu", attention_scale=float(c.head_dim) ** -0.5, embedding_scale=1.0,
            max_positions=c.max_position_embeddings, rope_frequencies=[rope_frequencies(c)], embedding=embedding,
            layers=[DecoderLayer(input_norm=layer.input_norm, qkv=layer.qkv, o=layer.o, pre_mlp_norm=layer.post_norm,
                                 gate_up=layer.gate_up, down=layer.down) for layer in self._layers],
            final_norm=self._final_norm, lm_head=lm_head,
        )

    @property
    def nbytes(self) -> int:
        """Bytes of every parameter as held: the packed projections and lm_head, the embedding
        table (float32, or quantized and shared with a tied lm_head) and norms."""
        arrays = [self._final_norm, *(layer.input_norm for layer in self._layers),
                  *(layer.post_norm for layer in self._layers)]
        return self._embedding_nbytes + sum(a.nbytes for a in arrays) + self.projection_nbytes

    def linears(self) -> list[Linear]:
        """Every projection a decode step multiplies by, the lm_head included."""
        return [self._lm_head, *(w for layer in self._layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down))]

    def kv_spec(self, dtype: str | None = None) -> KvSpec:
        """What this model keeps of K/V, layer by layer (every Llama layer attends over every
        earlier token with the same K/V heads and head size), stored as ``dtype`` (None: the
        core's default): what a :class:`~pagedkv.Scheduler` given it (``kv_spec=``) derives its KV
        cache groups from and allocates for its pool."""
        c = self.config
        layers = [LayerSpec(c.num_kv_heads, c.head_dim)] * c.num_layers
        return KvSpec(layers) if dtype is None else KvSpec(layers, dtype)


class _FusedLayer(NamedTuple):
    """One layer's weights in the forward pass's layout."""

    input_norm: np.ndarray
    qkv: Linear
    o: Linear
    post_norm: np.ndarray
    gate_up: Linear
    down: Linear


def _fuse(parts: dict[str, Tensor], weight_dtype: str, index: int) -> _FusedLayer:
    """Layer ``index``'s tensors (LayerWeights fields -> tensors) packed, ``[q|k|v]`` and
    ``[gate|up]`` fused."""
    layer = f"model.layers.{index}"
    return _FusedLayer(
        input_norm=float_tensor(parts["input_layernorm"], f"{layer}.input_layernorm"),
        qkv=fused_linear([parts["q_proj"], parts["k_proj"], parts["v_proj"]], weight_dtype, f"{layer}.qkv"),
        o=packed_linear(parts["o_proj"], weight_dtype, f"{layer}.o_proj"),
        post_norm=float_tensor(parts["post_attention_layernorm"], f"{layer}.post_attention_layernorm"),
        gate_up=fused_linear([parts["gate_proj"], parts["up_proj"]], weight_dtype, f"{layer}.gate_up"),
        down=packed_linear(parts["down_proj"], weight_dtype, f"{layer}.down_proj"),
    )
