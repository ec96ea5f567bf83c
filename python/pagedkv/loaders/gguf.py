"""A model from one GGUF file (llama.cpp's format): :func:`stream_gguf` gives the config, the
tokenizer and the tensors one at a time (what a streaming load packs from), of a Llama or a Gemma 3
file (:mod:`pagedkv.loaders.gguf_gemma3`); :func:`load_gguf` gives a Llama file's float32
:class:`~pagedkv.models.weights.LlamaWeights` and its tokenizer.

A Llama file's ``llama.*`` metadata becomes the :class:`LlamaConfig` (:func:`config_from_gguf`); its
tensors are renamed to the Hugging Face names the rest of the package uses, dequantized, and the
Q and K projections' rows put back in Hugging Face order (:func:`unpermute_qk`).

Invariants: like the safetensors loader, every tensor the config implies is checked present once,
with its shape, before any tensor data is read or the tokenizer is built; a setting this model does not implement (another
architecture, partial rotary embedding, rope scaling other than linear, precomputed rope factors,
experts) is refused with a :class:`CheckpointError` naming the file, never ignored.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pagedkv.errors import CheckpointError, InvalidArgumentError
from pagedkv.loaders.gguf_file import GGUFFile, read_gguf
from pagedkv.loaders.gguf_gemma3 import gemma3_config_from_gguf, gemma3_tensor, gemma3_tensor_names, num_gemma3_tensors
from pagedkv.loaders.tokenizers import tokenizer_from_gguf_metadata
from pagedkv.models.config import LlamaConfig, RopeScaling, _Fields, union_token_ids
from pagedkv.models.gemma3 import Gemma3Config
from pagedkv.models.layers import Tensor, float_tensor
from pagedkv.models.weights import LlamaWeights, expected_names, expected_shape, num_expected
from pagedkv.text.tokenizer import HFTokenizer

__all__ = ["load_gguf", "stream_gguf", "config_from_gguf", "unpermute_qk"]

PathLike = str | Path

# GGUF tensor name -> Hugging Face name ({i}: the layer).
_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_NAME = re.compile(r"blk\.(0|[1-9][0-9]{0,8})\.(.+)")


def load_gguf(path: PathLike) -> tuple[LlamaWeights, HFTokenizer]:
    """The weights (float32) and tokenizer of a Llama GGUF file. The embedding is tied to the
    output layer when the file has no ``output.weight``. Raises :class:`CheckpointError`, naming
    the file, for a malformed file, an unsupported architecture, setting or tensor type, or a
    missing or misshapen tensor (and for a Gemma 3 file: load it with ``load_model``)."""
    config, tokenizer, tensors = stream_gguf(path)
    if not isinstance(config, LlamaConfig):
        raise CheckpointError(Path(path), "not a Llama model: load_gguf gives Llama weights (load_model loads any)")
    return LlamaWeights.from_named_tensors(config, {n: float_tensor(t, n) for n, t in tensors}), tokenizer


def stream_gguf(
    path: PathLike, keep_quantized: bool = False
) -> tuple[LlamaConfig | Gemma3Config, HFTokenizer, Iterator[tuple[str, Tensor]]]:
    """The config and tokenizer of a Llama or Gemma 3 GGUF file, and its tensors as ``(Hugging
    Face name, float32 array)``, each read and dequantized only when the iterator reaches it (with
    ``keep_quantized``, a projection of a type the kernels read comes as a
    :class:`~pagedkv.models.layers.QuantizedTensor`, its rows as shipped).
    Every check of :func:`load_gguf` is made before this returns; reading raises
    :class:`CheckpointError` only if the file changes meanwhile."""
    gguf = read_gguf(path)
    config = config_from_gguf(gguf)
    if isinstance(config, Gemma3Config):
        try:
            names = gemma3_tensor_names(gguf, config)
        except InvalidArgumentError as error:
            raise CheckpointError(gguf.file.path, str(error)) from error
        num_missing = num_gemma3_tensors(config) - len(names)
        listed = f"{num_missing} of the model's tensors" if num_missing else ""
    else:
        names = _hf_names(gguf, config)
        num_missing = num_expected(config) - len(names)  # counted: a config may claim a million layers
        found = set(names.values())
        listed = ", ".join(itertools.islice((n for n in expected_names(config) if n not in found), 3))
        listed += f" and {num_missing - 3} more" if num_missing > 3 else ""
    if num_missing:
        raise CheckpointError(gguf.file.path, f"tensors missing: {listed} (Hugging Face names)")
    # Built only now, its vocabulary bounded by the embedding just checked: a tokenizer costs ~20
    # times the metadata it is built from.
    tokenizer = tokenizer_from_gguf_metadata(gguf.metadata, gguf.file.path, config.vocab_size)
    # The stream keeps only the tensor directory: the metadata (the vocabulary and merges as ~100k
    # Python strings) is dropped once the tokenizer is built, not held through the whole load.
    tensor_file = dataclasses.replace(gguf, metadata={})
    if isinstance(config, Gemma3Config):
        tensors = ((names[name], gemma3_tensor(names[name], array))
                   for name, array in tensor_file.stream(list(names), keep_quantized=keep_quantized))
        return config, tokenizer, tensors
    heads = {"attn_q.weight": config.num_heads, "attn_k.weight": config.num_kv_heads}

    def unpermute(name: str, raw: np.ndarray) -> np.ndarray:
        layer = _LAYER_NAME.fullmatch(name)
        return unpermute_qk(raw, heads[layer[2]]) if layer and layer[2] in heads else raw

    streamed = tensor_file.stream(list(names), transform=unpermute, keep_quantized=keep_quantized)
    return config, tokenizer, ((names[name], array) for name, array in streamed)


def config_from_gguf(gguf: GGUFFile) -> LlamaConfig | Gemma3Config:
    """The config of a GGUF file of architecture "llama" (a :class:`LlamaConfig`: its ``llama.*``
    metadata, bos/eos ids from ``tokenizer.ggml.*`` (``eot_token_id`` and ``eom_token_id`` also
    end generation, as in llama.cpp) and ``tie_word_embeddings`` from the absence of
    ``output.weight``) or "gemma3" (a :class:`Gemma3Config`,
    :func:`~pagedkv.loaders.gguf_gemma3.gemma3_config_from_gguf`)."""
    f = _Fields(gguf.metadata)
    try:
        arch = f.str_("general.architecture")
        if arch == "gemma3":
            return gemma3_config_from_gguf(f, gguf)
        if arch != "llama":
            raise InvalidArgumentError(f"general.architecture {arch!r} is not supported (llama, gemma3)")
        return _read_config(f, gguf)
    except InvalidArgumentError as error:
        raise CheckpointError(gguf.file.path, str(error)) from error


def _read_config(f: _Fields, gguf: GGUFFile) -> LlamaConfig:
    if f.int_("llama.expert_count", 0):
        raise InvalidArgumentError("llama.expert_count: mixtures of experts are not supported")
    if "rope_freqs.weight" in gguf.tensors:
        raise InvalidArgumentError("rope_freqs.weight: precomputed rope frequency factors (llama3 rope) are not supported")
    hidden_size, num_heads = f.int_("llama.embedding_length"), f.int_("llama.attention.head_count")
    head_dim = f.int_("llama.attention.key_length", hidden_size // num_heads if num_heads > 0 else 0)
    if f.int_("llama.attention.value_length", head_dim) != head_dim:
        raise InvalidArgumentError("llama.attention.value_length must equal key_length")
    if f.int_("llama.rope.dimension_count", head_dim) != head_dim:
        raise InvalidArgumentError(
            f"llama.rope.dimension_count must equal the head size {head_dim} (partial rotary embedding is not supported)"
        )
    tokens = f.get("tokenizer.ggml.tokens", lambda v: isinstance(v, list), "a list", [])
    return LlamaConfig(
        vocab_size=f.int_("llama.vocab_size", len(tokens)),
        hidden_size=hidden_size,
        intermediate_size=f.int_("llama.feed_forward_length"),
        num_layers=f.int_("llama.block_count"),
        num_heads=num_heads,
        num_kv_heads=f.int_("llama.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rope_theta=f.number("llama.rope.freq_base", 10000.0),
        rms_norm_eps=f.number("llama.attention.layer_norm_rms_epsilon"),
        max_position_embeddings=f.int_("llama.context_length"),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=f.int_("tokenizer.ggml.bos_token_id", None),
        eos_token_ids=union_token_ids(*(f.token_ids(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom"))),
        rope_scaling=_rope_scaling(f),
    )


def _rope_scaling(f: _Fields) -> RopeScaling | None:
    """``llama.rope.scaling.type`` "none" or "linear" (with ``.factor``), or the older
    ``llama.rope.scale_linear`` factor."""
    kind = f.str_("llama.rope.scaling.type", "none")
    if kind == "linear":
        return RopeScaling("linear", factor=f.number("llama.rope.scaling.factor"))
    if kind != "none":
        raise InvalidArgumentError(f"llama.rope.scaling.type {kind!r} is not supported (none, linear)")
    factor = f.number("llama.rope.scale_linear", 1.0)
    return RopeScaling("linear", factor=factor) if factor != 1.0 else None


def _hf_names(gguf: GGUFFile, config: LlamaConfig) -> dict[str, str]:
    """GGUF name -> Hugging Face name of each tensor of the file that the model has, its shape
    checked against the config (other tensors, e.g. rotary caches, are left out)."""
    names: dict[str, str] = {}
    for name, tensor in gguf.tensors.items():
        layer = _LAYER_NAME.fullmatch(name)
        hf_name = (f"model.layers.{layer[1]}.{LAYER_TENSORS[layer[2]]}" if layer and layer[2] in LAYER_TENSORS
                   else _GLOBAL_TENSORS.get(name))
        if hf_name is None or (expected := expected_shape(config, hf_name)) is None:
            continue
        if tensor.shape != expected:
            raise CheckpointError(
                gguf.file.path, f"tensor {name} ({hf_name}) has shape {tensor.shape}, but the metadata implies {expected}"
            )
        names[name] = hf_name
    return names


def unpermute_qk(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes the row order llama.cpp's converter gives a Q or K projection (``num_heads`` of its
    heads; K's are the K/V heads).

    Hugging Face rotates dimension ``j`` of a head with ``j + head_dim/2`` (``rotate_half``); ggml
    rotates adjacent pairs ``(2j, 2j+1)``. So the converter moves row ``t*head_dim/2 + j`` of each
    head (``t`` in {0, 1}) to row ``2j + t``; this moves it back. Works on any row content (float
    rows, or the raw bytes of quantized rows, since blocks never straddle rows); returns a copy."""
    shape = rows.shape
    head_dim = shape[0] // num_heads
    return np.ascontiguousarray(rows.reshape(num_heads, head_dim // 2, 2, *shape[1:]).swapaxes(1, 2)).reshape(shape)

