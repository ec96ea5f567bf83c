"""The parameters of a Llama decoder and their schema: each tensor's Hugging Face name and
expected shape for a config, and seeded random initialisation.

Tensors keep the Hugging Face layout (a linear layer's weight is ``[out_features, in_features]``)
and are float32 in memory. The schema here is the one table every loader checks against
(:mod:`pagedkv.loaders.checkpoint`, :mod:`pagedkv.loaders.gguf`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from pagedkv.models.config import LlamaConfig

__all__ = ["LAYER_TENSORS", "LayerWeights", "LlamaWeights", "expected_names", "expected_shape", "num_expected"]


@dataclass
class LayerWeights:
    """One decoder layer. Shapes: norms ``[hidden]``; ``q_proj`` ``[num_heads*head_dim, hidden]``;
    ``k_proj``/``v_proj`` ``[num_kv_heads*head_dim, hidden]``; ``o_proj`` ``[hidden,
    num_heads*head_dim]``; ``gate_proj``/``up_proj`` ``[intermediate, hidden]``; ``down_proj``
    ``[hidden, intermediate]``."""

    input_layernorm: np.ndarray
    q_proj: np.ndarray
    k_proj: np.ndarray
    v_proj: np.ndarray
    o_proj: np.ndarray
    post_attention_layernorm: np.ndarray
    gate_proj: np.ndarray
    up_proj: np.ndarray
    down_proj: np.ndarray


# LayerWeights field -> Hugging Face tensor name inside ``model.layers.{i}.``
LAYER_TENSORS = {
    "input_layernorm": "input_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "post_attention_layernorm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}


@dataclass
class LlamaWeights:
    """All parameters of a model. With tied embeddings ``lm_head`` is ``embed_tokens`` itself."""

    config: LlamaConfig
    embed_tokens: np.ndarray
    layers: list[LayerWeights]
    norm: np.ndarray
    lm_head: np.ndarray

    @classmethod
    def random(cls, config: LlamaConfig, seed: int = 0) -> LlamaWeights:
        """Seeded random weights. Embeddings are standard normal and each linear layer has
        standard deviation ``1/sqrt(in_features)``, so activations keep unit scale through the
        layers and the logits spread over a few units: sampling is non-degenerate and greedy
        argmax rarely meets near-ties. Norm weights are ones."""
        rng = np.random.default_rng(seed)

        def linear(out_features: int, in_features: int) -> np.ndarray:
            scale = 1.0 / np.sqrt(in_features)
            return (rng.standard_normal((out_features, in_features)) * scale).astype(np.float32)

        c = config
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        embed = rng.standard_normal((c.vocab_size, c.hidden_size)).astype(np.float32)
        layers = [
            LayerWeights(
                input_layernorm=np.ones(c.hidden_size, np.float32),
                q_proj=linear(q_dim, c.hidden_size),
                k_proj=linear(kv_dim, c.hidden_size),
                v_proj=linear(kv_dim, c.hidden_size),
                o_proj=linear(c.hidden_size, q_dim),
                post_attention_layernorm=np.ones(c.hidden_size, np.float32),
                gate_proj=linear(c.intermediate_size, c.hidden_size),
                up_proj=linear(c.intermediate_size, c.hidden_size),
                down_proj=linear(c.hidden_size, c.intermediate_size),
            )
            for _ in range(c.num_layers)
        ]
        lm_head = embed if c.tie_word_embeddings else linear(c.vocab_size, c.hidden_size)
        return cls(config, embed, layers, np.ones(c.hidden_size, np.float32), lm_head)

    def named_tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Every tensor under its Hugging Face name (no ``lm_head.weight`` when tied)."""
        yield "model.embed_tokens.weight", self.embed_tokens
        for i, layer in enumerate(self.layers):
            for field, suffix in LAYER_TENSORS.items():
                yield f"model.layers.{i}.{suffix}", getattr(layer, field)
        yield "model.norm.weight", self.norm
        if not self.config.tie_word_embeddings:
            yield "lm_head.weight", self.lm_head

    @classmethod
    def from_named_tensors(cls, config: LlamaConfig, tensors: Mapping[str, np.ndarray]) -> LlamaWeights:
        """Assembles weights from Hugging Face-named float32 tensors (shapes already checked)."""
        layers = [
            LayerWeights(**{field: tensors[f"model.layers.{i}.{suffix}"] for field, suffix in LAYER_TENSORS.items()})
            for i in range(config.num_layers)
        ]
        embed = tensors["model.embed_tokens.weight"]
        lm_head = embed if config.tie_word_embeddings else tensors["lm_head.weight"]
        return cls(config, embed, layers, tensors["model.norm.weight"], lm_head)


def expected_shape(c: LlamaConfig, name: str) -> tuple[int, ...] | None:
    """The shape the config implies for the Hugging Face tensor ``name``; None when the model has
    no such tensor. Parses the name, so checking a file's tensors costs nothing per config layer."""
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    if name.startswith("model.layers."):
        index, _, suffix = name[len("model.layers."):].partition(".")
        if not (index.isascii() and index.isdigit() and len(index) < 20 and index == str(int(index))
                and int(index) < c.num_layers):
            return None
        return {
            "input_layernorm.weight": (c.hidden_size,),
            "self_attn.q_proj.weight": (q_dim, c.hidden_size),
            "self_attn.k_proj.weight": (kv_dim, c.hidden_size),
            "self_attn.v_proj.weight": (kv_dim, c.hidden_size),
            "self_attn.o_proj.weight": (c.hidden_size, q_dim),
            "post_attention_layernorm.weight": (c.hidden_size,),
            "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        }.get(suffix)
    return {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
        "lm_head.weight": None if c.tie_word_embeddings else (c.vocab_size, c.hidden_size),
    }.get(name)


def expected_names(c: LlamaConfig) -> Iterator[str]:
    """Every tensor name the config implies, lazily (a config may claim a million layers)."""
    yield "model.embed_tokens.weight"
    for i in range(c.num_layers):
        for suffix in LAYER_TENSORS.values():
            yield f"model.layers.{i}.{suffix}"
    yield "model.norm.weight"
    if not c.tie_word_embeddings:
        yield "lm_head.weight"


def num_expected(c: LlamaConfig) -> int:
    """How many names :func:`expected_names` yields."""
    return 2 + len(LAYER_TENSORS) * c.num_layers + (0 if c.tie_word_embeddings else 1)
