"""The parameters of a Llama decoder: seeded random initialisation, and Hugging Face checkpoint
directories (``config.json`` + ``*.safetensors``, sharded or not) read and written.

Tensors keep the Hugging Face layout (a linear layer's weight is ``[out_features, in_features]``)
and are float32 in memory whatever their dtype on disk (float32, float16 or bfloat16).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Container, Iterator, Mapping, Union

import numpy as np

from pagedkv.errors import CheckpointError, InvalidArgumentError
from pagedkv.model.config import LlamaConfig

__all__ = ["LayerWeights", "LlamaWeights", "load_config", "load_checkpoint", "save_checkpoint", "CONFIG_FILE", "INDEX_FILE"]

PathLike = Union[str, Path]

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# On-disk dtype names of the safetensors header -> how to read them.
_DISK_DTYPES: dict[str, np.dtype] = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
# Dtypes save_checkpoint can write -> safetensors TensorSpec dtype name.
_SAVE_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


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
_LAYER_TENSORS = {
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
            for field, suffix in _LAYER_TENSORS.items():
                yield f"model.layers.{i}.{suffix}", getattr(layer, field)
        yield "model.norm.weight", self.norm
        if not self.config.tie_word_embeddings:
            yield "lm_head.weight", self.lm_head

    @classmethod
    def from_named_tensors(cls, config: LlamaConfig, tensors: Mapping[str, np.ndarray]) -> LlamaWeights:
        """Assembles weights from Hugging Face-named float32 tensors (shapes already checked)."""
        layers = [
            LayerWeights(**{field: tensors[f"model.layers.{i}.{suffix}"] for field, suffix in _LAYER_TENSORS.items()})
            for i in range(config.num_layers)
        ]
        embed = tensors["model.embed_tokens.weight"]
        lm_head = embed if config.tie_word_embeddings else tensors["lm_head.weight"]
        return cls(config, embed, layers, tensors["model.norm.weight"], lm_head)


def _expected_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape implied by the config (``lm_head`` only when untied)."""
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (c.hidden_size,),
        "self_attn.q_proj.weight": (q_dim, c.hidden_size),
        "self_attn.k_proj.weight": (kv_dim, c.hidden_size),
        "self_attn.v_proj.weight": (kv_dim, c.hidden_size),
        "self_attn.o_proj.weight": (c.hidden_size, q_dim),
        "post_attention_layernorm.weight": (c.hidden_size,),
        "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
    }
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        shapes.update({f"model.layers.{i}.{suffix}": shape for suffix, shape in per_layer.items()})
    shapes["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def load_config(directory: PathLike) -> LlamaConfig:
    """Reads ``config.json`` of a checkpoint directory. Raises :class:`CheckpointError` naming the
    file when it is missing, is not JSON, or describes an unsupported model."""
    path = Path(directory) / CONFIG_FILE
    hf = _read_json(path)
    if not isinstance(hf, dict):
        raise CheckpointError(path, "expected a JSON object")
    try:
        return LlamaConfig.from_hf_dict(hf)
    except InvalidArgumentError as error:
        raise CheckpointError(path, str(error)) from error


def load_checkpoint(directory: PathLike) -> LlamaWeights:
    """Loads a Hugging Face Llama checkpoint directory: ``config.json`` and either
    ``model.safetensors.index.json`` with the shards it names or every ``*.safetensors`` file.
    Each tensor is converted to float32 and checked against the shape the config implies.

    Raises :class:`CheckpointError`, naming the file, for a missing or malformed config, no
    safetensors file, an unreadable file, an unsupported tensor dtype, a wrong shape, or a
    missing tensor.
    """
    directory = Path(directory)
    config = load_config(directory)
    expected = _expected_shapes(config)
    tensors: dict[str, np.ndarray] = {}
    for path in _weight_files(directory):
        for name, array in _read_safetensors(path, wanted=expected.keys()):
            if array.shape != expected[name]:
                raise CheckpointError(
                    path, f"tensor {name} has shape {array.shape}, but {CONFIG_FILE} implies {expected[name]}"
                )
            tensors[name] = array
    missing = [name for name in expected if name not in tensors]
    if missing:
        listed = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise CheckpointError(directory, f"tensors missing from the safetensors files: {listed}")
    return LlamaWeights.from_named_tensors(config, tensors)


def save_checkpoint(
    weights: LlamaWeights, directory: PathLike, dtype: str = "float32", max_shard_bytes: int | None = None
) -> None:
    """Writes ``weights`` as a Hugging Face checkpoint directory (created if needed):
    ``config.json`` plus ``model.safetensors``, or, when the tensors exceed ``max_shard_bytes``,
    shards ``model-0000i-of-0000n.safetensors`` with a ``model.safetensors.index.json``.
    ``dtype`` is the on-disk type: "float32", "float16" or "bfloat16" (rounded to nearest even)."""
    if dtype not in _SAVE_DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {sorted(_SAVE_DTYPES)}, got {dtype!r}")
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise InvalidArgumentError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(weights.config.to_hf_dict(), indent=2) + "\n")

    encoded = [(name, _encode(array, dtype)) for name, array in weights.named_tensors()]
    shards: list[list[tuple[str, np.ndarray]]] = [[]]
    shard_bytes = 0
    for name, array in encoded:
        if max_shard_bytes is not None and shards[-1] and shard_bytes + array.nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, array))
        shard_bytes += array.nbytes
    if len(shards) == 1:
        _write_safetensors(directory / SINGLE_FILE, shards[0], dtype)
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(directory / file_name, shard, dtype)
        weight_map.update({name: file_name for name, _ in shard})
    index = {"metadata": {"total_size": sum(a.nbytes for _, a in encoded)}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _read_json(path: Path) -> object:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CheckpointError(path, "file not found") from None
    except OSError as error:
        raise CheckpointError(path, f"cannot read: {error}") from error
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise CheckpointError(path, f"malformed JSON: {error}") from error


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names, else every ``*.safetensors``."""
    index_path = directory / INDEX_FILE
    if index_path.exists():
        index = _read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(index_path, 'expected an object with a "weight_map" of tensor name -> file name')
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for path in files:
            if not path.is_file():
                raise CheckpointError(path, f"file not found (named by {INDEX_FILE})")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(directory, "no *.safetensors file in the checkpoint directory")
    return files


def _read_safetensors(path: Path, wanted: Container[str]) -> Iterator[tuple[str, np.ndarray]]:
    """Yields the float32 tensors of a safetensors file whose names are in ``wanted`` (others,
    such as rotary caches some exporters add, are skipped). Reads the whole file: numpy has no
    bfloat16, so tensors come out of :func:`safetensors.deserialize` as raw bytes and are
    widened here."""
    from safetensors import SafetensorError, deserialize

    try:
        entries = deserialize(path.read_bytes())
    except OSError as error:
        raise CheckpointError(path, f"cannot read: {error}") from error
    except SafetensorError as error:
        raise CheckpointError(path, f"not a valid safetensors file: {error}") from error
    for name, entry in entries:  # entry: {"dtype": "F32", "shape": [...], "data": bytes}
        if name not in wanted:
            continue
        disk_dtype = _DISK_DTYPES.get(entry["dtype"])
        if disk_dtype is None:
            raise CheckpointError(
                path, f"tensor {name} has dtype {entry['dtype']}; supported: {', '.join(_DISK_DTYPES)}"
            )
        raw = np.frombuffer(entry["data"], dtype=disk_dtype).reshape(entry["shape"])
        yield name, _widen(raw, entry["dtype"])


def _widen(raw: np.ndarray, disk_dtype: str) -> np.ndarray:
    """float32 copy of an on-disk array (bfloat16 arrives as its uint16 bit pattern)."""
    if disk_dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def _encode(array: np.ndarray, dtype: str) -> np.ndarray:
    """The contiguous on-disk form of a float32 array (bfloat16 as uint16 bits, rounded to
    nearest even)."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if dtype == "float16":
        return array.astype(np.float16)
    if dtype == "bfloat16":
        bits = array.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return rounded.astype(np.uint16)
    return array


def _write_safetensors(path: Path, tensors: list[tuple[str, np.ndarray]], dtype: str) -> None:
    from safetensors import TensorSpec, serialize_file

    specs = {
        name: TensorSpec(dtype=_SAVE_DTYPES[dtype], shape=array.shape, data_ptr=array.ctypes.data, data_len=array.nbytes)
        for name, array in tensors
    }
    # "pt" is the format tag Hugging Face loaders require; the bytes are framework-neutral.
    serialize_file(specs, str(path), metadata={"format": "pt"})
