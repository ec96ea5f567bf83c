"""Hugging Face checkpoint directories (``config.json`` + ``*.safetensors``, sharded or not), read
and written; float32, float16 or bfloat16 on disk, float32 in memory.

Loading invariants: files are opened only through :class:`~pagedkv.loaders.files.CheckpointFile`
(regular files inside the directory); nothing costs time or memory per layer the config claims
before the safetensors headers have shown those layers' tensors exist; tensor data is read only
after every header check passed, so a refused checkpoint allocates no weights.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from pagedkv.errors import CheckpointError, InvalidArgumentError
from pagedkv.loaders.files import CheckpointFile, is_present
from pagedkv.models.config import LlamaConfig, generation_eos_token_ids, union_token_ids
from pagedkv.models.weights import LlamaWeights, expected_names, expected_shape, num_expected

__all__ = ["load_config", "load_checkpoint", "stream_checkpoint", "save_checkpoint", "CONFIG_FILE", "INDEX_FILE",
           "GENERATION_CONFIG_FILE"]

PathLike = str | Path
T = TypeVar("T")

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SINGLE_FILE = "model.safetensors"

# On-disk dtype names of the safetensors header -> how to read them.
_DISK_DTYPES: dict[str, np.dtype] = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
# Dtypes save_checkpoint can write -> safetensors TensorSpec dtype name.
_SAVE_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def load_config(directory: PathLike) -> LlamaConfig:
    """Reads ``config.json`` of a checkpoint directory, and ``generation_config.json`` when it is
    present: its ``eos_token_id`` ids are added after those of ``config.json`` (each id once, in
    order), since generation stops on any of them. Raises :class:`CheckpointError` naming the
    file (and the key) when a file is missing, unsafe, not UTF-8 JSON, or describes a model of the
    wrong types or one this package does not implement."""
    directory = Path(directory)
    config = _parse(CheckpointFile.locate(directory, CONFIG_FILE), LlamaConfig.from_hf_dict)
    if not is_present(directory, GENERATION_CONFIG_FILE):
        return config

    def add_eos(generation: Mapping[str, Any]) -> LlamaConfig:
        return config.replace(eos_token_ids=union_token_ids(config.eos_token_ids, generation_eos_token_ids(generation)))

    return _parse(CheckpointFile.locate(directory, GENERATION_CONFIG_FILE), add_eos)


def _parse(file: CheckpointFile, read: Callable[[Mapping[str, Any]], T]) -> T:
    """``read`` applied to the JSON object in ``file``; its InvalidArgumentError becomes a
    CheckpointError naming the file."""
    content = file.read_json()
    if not isinstance(content, dict):
        raise CheckpointError(file.path, "expected a JSON object")
    try:
        return read(content)
    except InvalidArgumentError as error:
        raise CheckpointError(file.path, str(error)) from error


def load_checkpoint(directory: PathLike) -> LlamaWeights:
    """Loads a Hugging Face Llama checkpoint directory: ``config.json`` (with
    ``generation_config.json``, see :func:`load_config`) and either
    ``model.safetensors.index.json`` with the shards it names or every ``*.safetensors`` file.
    Every file must be a regular file inside the directory (symlinks resolved).

    The files' headers are checked against the config before any tensor is read: every tensor
    the config implies must be present once, with that shape and a supported dtype (float32,
    float16, bfloat16), so memory is only allocated for tensors the files actually hold. Each
    is then read and converted to float32.

    Raises :class:`CheckpointError`, naming the file, for a missing, unsafe or malformed config
    or index, no safetensors file, an unreadable or malformed file, an unsupported tensor dtype, a
    wrong shape, a tensor in two files, or a missing tensor.
    """
    config, tensors = stream_checkpoint(directory)
    return LlamaWeights.from_named_tensors(config, dict(tensors))


def stream_checkpoint(directory: PathLike) -> tuple[LlamaConfig, Iterator[tuple[str, np.ndarray]]]:
    """The config of a checkpoint directory and its tensors as ``(name, float32 array)``, each
    read only when the iterator reaches it; every check of :func:`load_checkpoint` is made before
    this returns."""
    directory = Path(directory)
    config = load_config(directory)
    found: dict[str, _Tensor] = {}
    for file in _weight_files(directory):
        for name, tensor in _read_header(file).items():
            expected = expected_shape(config, name)
            if expected is None:
                continue  # not part of the model (e.g. rotary caches some exporters add)
            if name in found:
                raise CheckpointError(file.path, f"tensor {name} is also in {found[name].file.path.name}")
            if tensor.shape != expected:
                raise CheckpointError(
                    file.path, f"tensor {name} has shape {tensor.shape}, but {CONFIG_FILE} implies {expected}"
                )
            if tensor.dtype not in _DISK_DTYPES:
                raise CheckpointError(file.path, f"tensor {name} has dtype {tensor.dtype}; supported: {', '.join(_DISK_DTYPES)}")
            found[name] = tensor
    num_missing = num_expected(config) - len(found)
    if num_missing:
        listed = ", ".join(itertools.islice((n for n in expected_names(config) if n not in found), 3))
        more = f" and {num_missing - 3} more" if num_missing > 3 else ""
        raise CheckpointError(directory, f"tensors missing from the safetensors files: {listed}{more}")
    return config, _read_tensors(found)


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


def _weight_files(directory: Path) -> list[CheckpointFile]:
    """The safetensors files of a checkpoint: those its index names, else every ``*.safetensors``."""
    if is_present(directory, INDEX_FILE):
        index_file = CheckpointFile.locate(directory, INDEX_FILE)
        index = index_file.read_json()
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(index_file.path, 'expected an object with a "weight_map" of tensor name -> file name')
        return [CheckpointFile.locate(directory, name, named_by=INDEX_FILE) for name in sorted(set(weight_map.values()))]
    files = [CheckpointFile.locate(directory, path.name) for path in sorted(directory.glob("*.safetensors"))]
    if not files:
        raise CheckpointError(directory, "no *.safetensors file in the checkpoint directory")
    return files


# The safetensors format's own limit on the JSON header.
_MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class _Tensor:
    """Where one tensor lies in a safetensors file, as its header says."""

    file: CheckpointFile
    dtype: str
    shape: tuple[int, ...]
    offset: int  # of its first byte, from the start of the file
    nbytes: int


def _read_header(file: CheckpointFile) -> dict[str, _Tensor]:
    """The tensors a safetensors file declares (an 8-byte little-endian header length, a JSON
    header of name -> dtype, shape, data_offsets, then the data). Reads only the header; its
    length is checked against the file's size before it is read, and every tensor's byte range
    against the data that follows."""
    def invalid(detail: str) -> CheckpointError:
        return CheckpointError(file.path, f"not a valid safetensors file: {detail}")

    with file.open() as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        header_len = int.from_bytes(prefix, "little")
        if len(prefix) < 8 or header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise invalid(f"header length {header_len} does not fit in the file's {size} bytes "
                          f"or the {_MAX_HEADER_BYTES}-byte limit")
        raw_header = f.read(header_len)
    try:
        header = json.loads(raw_header.decode("utf-8"))
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise invalid(f"header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise invalid("header is not a JSON object")
    data_start, data_len = 8 + header_len, size - 8 - header_len
    tensors: dict[str, _Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, offsets = (
            (entry.get(k) for k in ("dtype", "shape", "data_offsets")) if isinstance(entry, dict) else (None,) * 3
        )
        if not (isinstance(dtype, str) and isinstance(shape, list) and all(_is_size(d) for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(_is_size(o) for o in offsets)
                and offsets[0] <= offsets[1] <= data_len):
            raise invalid(f"tensor {name!r} has a malformed entry {str(entry)[:80]}")
        nbytes = offsets[1] - offsets[0]
        itemsize = _DISK_DTYPES[dtype].itemsize if dtype in _DISK_DTYPES else None
        if itemsize is not None and nbytes != math.prod(shape) * itemsize:
            raise invalid(f"tensor {name} holds {nbytes} bytes, not the {math.prod(shape) * itemsize} of {dtype} {shape}")
        tensors[name] = _Tensor(file, dtype, tuple(shape), data_start + offsets[0], nbytes)
    return tensors


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _read_tensors(tensors: Mapping[str, _Tensor]) -> Iterator[tuple[str, np.ndarray]]:
    """The float32 arrays of ``tensors`` (already checked against their file's header) in turn,
    each file opened once."""
    by_file: dict[Path, list[tuple[str, _Tensor]]] = {}
    for name, tensor in tensors.items():
        by_file.setdefault(tensor.file.real, []).append((name, tensor))
    for group in by_file.values():
        file = group[0][1].file
        with file.open() as f:
            for name, tensor in group:
                f.seek(tensor.offset)
                data = f.read(tensor.nbytes)
                if len(data) != tensor.nbytes:
                    raise CheckpointError(file.path, f"tensor {name} is cut short ({len(data)} of {tensor.nbytes} bytes)")
                raw = np.frombuffer(data, dtype=_DISK_DTYPES[tensor.dtype]).reshape(tensor.shape)
                yield name, _widen(raw, tensor.dtype)


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
