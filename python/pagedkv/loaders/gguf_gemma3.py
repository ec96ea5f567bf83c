"""A Gemma 3 model from a GGUF file (``general.architecture`` "gemma3"): its config from the
``gemma3.*`` metadata (:func:`gemma3_config_from_gguf`) and its tensors under the Hugging Face
names :class:`~pagedkv.models.gemma3.Gemma3Model` takes (:func:`gemma3_tensor_names`).

What the file does not say, taken as llama.cpp takes it: local layers rotate with base 10,000;
every sixth layer is global; attention is scaled by ``head_dim ** -0.5`` (the 27B model, 62
layers, by ``(hidden / heads) ** -0.5``). llama.cpp's converter stores every norm weight as
``1 + weight`` and does not permute Q and K (Gemma rotates half-split pairs, as transformers
does); :func:`gemma3_tensor` undoes the former, as transformers' GGUF loader does.

Invariants: as :mod:`pagedkv.loaders.gguf` — every tensor the config implies is checked present
with its shape before any tensor data is read; a setting this model does not implement (an
untied output layer, rope scaling other than linear) is refused, never ignored.
"""

from __future__ import annotations

import re

import numpy as np

from pagedkv.errors import InvalidArgumentError
from pagedkv.loaders.gguf_file import GGUFFile
from pagedkv.models.config import _Fields, union_token_ids
from pagedkv.models.gemma3 import GEMMA3_LAYER_TENSORS, Gemma3Config, expected_gemma3_shape
from pagedkv.models.layers import Tensor

__all__ = ["gemma3_config_from_gguf", "gemma3_tensor_names", "gemma3_tensor", "num_gemma3_tensors"]

# GGUF name inside ``blk.{i}.`` -> the packed layer's field (GEMMA3_LAYER_TENSORS names its HF tensor).
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm",
    "attn_q.weight": "q_proj",
    "attn_k.weight": "k_proj",
    "attn_v.weight": "v_proj",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "attn_output.weight": "o_proj",
    "post_attention_norm.weight": "post_attention_layernorm",
    "ffn_norm.weight": "pre_feedforward_layernorm",
    "ffn_gate.weight": "gate_proj",
    "ffn_up.weight": "up_proj",
    "ffn_down.weight": "down_proj",
    "post_ffw_norm.weight": "post_feedforward_layernorm",
}
_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
_LAYER_NAME = re.compile(r"blk\.(0|[1-9][0-9]{0,8})\.(.+)")

# The 27B model (62 layers) scales attention by (hidden / heads) ** -0.5, the others by head_dim ** -0.5.
_LAYERS_OF_27B = 62


def gemma3_config_from_gguf(f: _Fields, gguf: GGUFFile) -> Gemma3Config:
    """The :class:`Gemma3Config` of a "gemma3" GGUF file's metadata (``f`` reads it). Raises
    :class:`InvalidArgumentError` naming the key for a missing, malformed or unsupported setting."""
    if "output.weight" in gguf.tensors:
        raise InvalidArgumentError("output.weight: an output layer not tied to the embeddings is not supported for gemma3")
    hidden, heads = f.int_("gemma3.embedding_length"), f.int_("gemma3.attention.head_count")
    head_dim = f.int_("gemma3.attention.key_length", hidden // heads if heads > 0 else 0)
    if f.int_("gemma3.attention.value_length", head_dim) != head_dim:
        raise InvalidArgumentError("gemma3.attention.value_length must equal key_length")
    num_layers = f.int_("gemma3.block_count")
    scaling = f.str_("gemma3.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise InvalidArgumentError(f"gemma3.rope.scaling.type {scaling!r} is not supported (none, linear)")
    tokens = f.get("tokenizer.ggml.tokens", lambda v: isinstance(v, list), "a list", [])
    return Gemma3Config(
        vocab_size=f.int_("gemma3.vocab_size", len(tokens)),
        hidden_size=hidden,
        intermediate_size=f.int_("gemma3.feed_forward_length"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=f.int_("gemma3.attention.head_count_kv", heads),
        head_dim=head_dim,
        sliding_window=f.int_("gemma3.attention.sliding_window"),
        rope_theta=f.number("gemma3.rope.freq_base", 1_000_000.0),
        rope_scaling_factor=f.number("gemma3.rope.scaling.factor") if scaling == "linear" else 1.0,
        query_pre_attn_scalar=float(hidden // heads if num_layers == _LAYERS_OF_27B and heads > 0 else head_dim),
        rms_norm_eps=f.number("gemma3.attention.layer_norm_rms_epsilon"),
        max_position_embeddings=f.int_("gemma3.context_length"),
        bos_token_id=f.int_("tokenizer.ggml.bos_token_id", None),
        eos_token_ids=union_token_ids(*(f.token_ids(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot"))),
    )


def gemma3_tensor_names(gguf: GGUFFile, config: Gemma3Config) -> dict[str, str]:
    """GGUF name -> Hugging Face name of each tensor of the file the model has (others are left
    out). Raises :class:`InvalidArgumentError` for a tensor whose shape the config contradicts."""
    names: dict[str, str] = {}
    for name, tensor in gguf.tensors.items():
        layer = _LAYER_NAME.fullmatch(name)
        field = _LAYER_TENSORS.get(layer[2]) if layer else None
        hf_name = f"model.layers.{layer[1]}.{GEMMA3_LAYER_TENSORS[field]}" if layer and field else _GLOBAL_TENSORS.get(name)
        if hf_name is None or (expected := expected_gemma3_shape(config, hf_name)) is None:
            continue
        if tensor.shape != expected:
            raise InvalidArgumentError(f"tensor {name} ({hf_name}) has shape {tensor.shape}, but the metadata implies {expected}")
        names[name] = hf_name
    return names


def gemma3_tensor(hf_name: str, values: Tensor) -> Tensor:
    """A tensor as the model takes it: a norm weight (float32) back from llama.cpp's ``1 + weight``."""
    if isinstance(values, np.ndarray) and hf_name.endswith("norm.weight"):
        return values - np.float32(1.0)
    return values


def num_gemma3_tensors(config: Gemma3Config) -> int:
    """How many tensors the model of ``config`` has."""
    return len(_GLOBAL_TENSORS) + len(_LAYER_TENSORS) * config.num_layers
