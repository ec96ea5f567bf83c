"""The GGUF file format (llama.cpp's single-file checkpoints): :func:`read_gguf` parses the header
(metadata and tensor directory) and :meth:`GGUFFile.stream` reads tensors dequantized to float32,
or a projection kept in its quantized format as shipped, one at a time.

The header is parsed here rather than by ``gguf.GGUFReader``: that reader makes several numpy
memmap views per string, and SmolLM2's header (49,152 tokens, 48,900 merges) took it 9 to 15 s
on this 2-core machine, against 0.2 to 0.4 s here. The ``gguf`` package (the one maintained with
llama.cpp) still supplies the format's constants and the dequantization (``gguf.quants``), which
is vectorized over blocks.

Invariants: the file is opened through :class:`~pagedkv.loaders.files.CheckpointFile` (a regular
file); every length, count and offset in the header is checked against the file's size before it
is used, so a malformed or hostile file raises :class:`CheckpointError` naming it and never makes
this allocate more than the file holds; the metadata's arrays hold at most
:data:`MAX_METADATA_ITEMS` items in all, so the header's Python objects are bounded whatever the
file declares; only the tensor types in :data:`SUPPORTED_TYPES` are
accepted, and their byte sizes are checked against the tensor's shape.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, quants

from pagedkv.errors import CheckpointError
from pagedkv.loaders.files import CheckpointFile
from pagedkv.models.layers import QuantizedTensor, Tensor

__all__ = ["GGUFFile", "GGUFTensor", "MAX_METADATA_ITEMS", "read_gguf", "SUPPORTED_TYPES"]

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # v1 had 32-bit counts; llama.cpp has written v3 since 2023
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 8  # arrays of arrays of ...; the format allows them, no model key uses more than one level

# Array items in all the metadata. The largest tokenizers shipped as GGUF hold under 800k (Gemma 3:
# 262,144 tokens with their scores and types; Llama 3: 128,256 tokens, 280,147 merges and the
# types); 2**21 leaves room for 2.5 times that. Each item becomes a Python object (a short str is
# ~60 bytes), so this bounds the parsed header near 150 MB where the file alone would allow one
# object per 8 bytes: a 60 MB file declaring 4 M tokens took 13 s and 1.4 GB before (issue 23).
MAX_METADATA_ITEMS = 2**21

# The tensor types this loader reads: the float types, the legacy quants and the K-quants of the
# common 4- to 6-bit presets (Q4_K_M mixes Q4_K, Q5_0, Q6_K and Q8_0; tests/models/test_gguf_quants.py
# holds each dequantization to a scalar transcription of ggml's). Others (Q2_K and Q3_K, the IQ
# and ternary types) are refused by name.
SUPPORTED_TYPES = frozenset({
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
})

# The types the quantized kernels read as shipped (``pagedkv._core.Linear.quantized``): every
# quantized type of the registry's SmolLM2 (Q4_1, Q8_0) and Gemma 3 (Q4_K_M: Q4_K, Q5_0, Q6_K,
# Q8_0) files, and Q4_0. Q5_1 and Q5_K are still dequantized.
KEPT_QUANTIZED = frozenset({
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K,
})

# Fixed-size metadata value types -> struct format (little-endian).
_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.FLOAT64: "<d", GGUFValueType.BOOL: "<?",
}


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of the tensor directory. ``shape`` is in numpy order (rows first: GGUF lists the
    innermost dimension first, so it is reversed); ``offset`` is from the start of the file."""

    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF header: the metadata (key -> int, float, bool, str or list of them) and the
    tensors by name."""

    file: CheckpointFile
    metadata: Mapping[str, Any]
    tensors: Mapping[str, GGUFTensor]

    def stream(
        self, names: list[str], transform: Callable[[str, np.ndarray], np.ndarray] | None = None,
        keep_quantized: bool = False,
    ) -> Iterator[tuple[str, Tensor]]:
        """The named tensors in turn, each as ``(name, float32 array of its numpy shape)``, the
        file opened once for the whole iteration; with ``keep_quantized``, a 2-D tensor of a type
        in :data:`KEPT_QUANTIZED` comes as a :class:`~pagedkv.models.layers.QuantizedTensor` of
        its raw rows instead.

        ``transform(name, raw)`` may reorder the raw rows (a ``[rows, bytes per row]`` uint8
        array) before they are dequantized; it must keep their shape. A tensor's bytes are read
        only when the consumer asks for it, into a buffer of their own dropped once decoded, so
        a consumer that keeps nothing holds one tensor's raw bytes and float32 values at a time."""
        with self.file.open() as f:
            for name in names:
                tensor = self.tensors[name]
                rows = math.prod(tensor.shape[:-1])
                raw = np.empty((rows, tensor.nbytes // rows), np.uint8)
                try:
                    f.seek(tensor.offset)
                    complete = f.readinto(memoryview(raw).cast("B")) == tensor.nbytes
                except OSError as error:
                    raise CheckpointError(self.file.path, f"cannot read tensor {name}: {error}") from error
                if not complete:
                    raise CheckpointError(self.file.path, f"tensor {name} is cut short (the file changed while read?)")
                if transform is not None:
                    raw = transform(name, raw)
                if keep_quantized and tensor.type in KEPT_QUANTIZED and len(tensor.shape) == 2:
                    yield name, QuantizedTensor(tensor.type.name.lower(), tensor.shape, raw)
                    del raw
                    continue
                # gguf.quants is vectorized over blocks; F32 comes back as a view of raw, uncopied.
                values = quants.dequantize(raw, tensor.type).reshape(tensor.shape)
                del raw
                yield name, values
                del values

    def read(self, names: list[str], transform: Callable[[str, np.ndarray], np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """All of :meth:`stream` at once, as a dict of float32 arrays."""
        return {name: values for name, values in self.stream(names, transform) if isinstance(values, np.ndarray)}


def read_gguf(path: str | Path) -> GGUFFile:
    """Parses the header of the GGUF file at ``path`` (which must be a regular file). Raises
    :class:`CheckpointError`, naming the file, when it is not a little-endian GGUF file of version
    2 or 3, is cut short, or declares a tensor of an unsupported type, of a size that does not
    match its shape, or lying outside the file."""
    path = Path(path)
    file = CheckpointFile.locate(path.parent, path.name)
    with file.open() as f:
        try:
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as error:  # ValueError: an empty file cannot be mapped
            raise CheckpointError(file.path, f"not a GGUF file: cannot map it ({error})") from None
    try:
        return _Parser(file, mapping).parse()
    finally:
        mapping.close()


class _Parser:
    """A cursor over the header bytes; every read is bounds-checked."""

    def __init__(self, file: CheckpointFile, data: mmap.mmap) -> None:
        self._file = file
        self._data = data
        self._size = len(data)
        self._pos = 0
        self._items = 0  # array items read so far (MAX_METADATA_ITEMS)

    def fail(self, detail: str) -> CheckpointError:
        return CheckpointError(self._file.path, f"not a valid GGUF file: {detail}")

    def parse(self) -> GGUFFile:
        if self._take(4) != _MAGIC:
            raise self.fail("it does not start with the GGUF magic")
        version = self._scalar("<I")
        if version not in _VERSIONS:
            big_endian = version & 0xFFFF == 0
            raise CheckpointError(self._file.path, "big-endian GGUF files are not supported" if big_endian
                                  else f"GGUF version {version} is not supported ({', '.join(map(str, _VERSIONS))})")
        tensor_count, kv_count = self._scalar("<Q"), self._scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(self._count(kv_count, 12)):  # a key (8-byte length) and a 4-byte type at least
            key = self._string()
            if key in metadata:
                raise self.fail(f"metadata key {key!r} appears twice")
            metadata[key] = self._value(self._scalar("<I"), key, 0)
        entries = [self._tensor_entry() for _ in range(self._count(tensor_count, 24))]
        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not (type(alignment) is int and alignment > 0 and alignment & (alignment - 1) == 0):
            raise self.fail(f"general.alignment {alignment!r} is not a power of two")
        data_start = -(-self._pos // alignment) * alignment
        tensors: dict[str, GGUFTensor] = {}
        for name, tensor_type, shape, relative in entries:
            if name in tensors:
                raise self.fail(f"tensor {name} appears twice")
            tensors[name] = self._locate(name, tensor_type, shape, relative, data_start, alignment)
        return GGUFFile(self._file, metadata, tensors)

    def _take(self, n: int) -> bytes:
        if n > self._size - self._pos:
            raise self.fail(f"cut short at byte {self._pos} (needs {n} more of {self._size})")
        chunk = self._data[self._pos:self._pos + n]
        self._pos += n
        return chunk

    def _scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _count(self, count: int, min_item_bytes: int) -> int:
        """``count`` items of at least ``min_item_bytes`` each, refused if the rest of the file
        cannot hold them (so no count makes the parser loop or allocate past the file)."""
        if count * min_item_bytes > self._size - self._pos:
            raise self.fail(f"a count of {count} at byte {self._pos} exceeds the file's {self._size} bytes")
        return count

    def _string(self) -> str:
        raw = self._take(self._count(self._scalar("<Q"), 1))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"a string before byte {self._pos} is not UTF-8") from None

    def _value(self, raw_type: int, key: str, depth: int) -> Any:
        try:
            value_type = GGUFValueType(raw_type)
        except ValueError:
            raise self.fail(f"metadata {key!r} has unknown value type {raw_type}") from None
        if value_type in _SCALARS:
            value = self._scalar(_SCALARS[value_type])
            # A float32 stands for the shortest decimal that rounds to it (1e-05, not 9.99999974e-06),
            # as the config.json it was converted from wrote it.
            return float(str(np.float32(value))) if value_type == GGUFValueType.FLOAT32 else value
        if value_type == GGUFValueType.STRING:
            return self._string()
        if depth >= _MAX_NESTING:
            raise self.fail(f"metadata {key!r} nests arrays deeper than {_MAX_NESTING}")
        item_type, length = self._scalar("<I"), self._scalar("<Q")
        self._items += length
        if self._items > MAX_METADATA_ITEMS:
            raise self.fail(f"metadata {key!r} brings its arrays past {MAX_METADATA_ITEMS} items in all")
        if item_type in _SCALARS:  # read in one go: vocabularies hold tens of thousands of ids
            dtype = np.dtype(_SCALARS[GGUFValueType(item_type)])
            items = np.frombuffer(self._take(self._count(length, dtype.itemsize) * dtype.itemsize), dtype)
            if item_type == GGUFValueType.FLOAT32:
                return [float(str(v)) for v in items]
            return items.tolist()
        min_bytes = 8 if item_type == GGUFValueType.STRING else 12
        return [self._value(item_type, key, depth + 1) for _ in range(self._count(length, min_bytes))]

    def _tensor_entry(self) -> tuple[str, int, tuple[int, ...], int]:
        name = self._string()
        n_dims = self._scalar("<I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise self.fail(f"tensor {name} has {n_dims} dimensions (1 to {_MAX_DIMS})")
        dims = [self._scalar("<Q") for _ in range(n_dims)]
        tensor_type, relative = self._scalar("<I"), self._scalar("<Q")
        return name, tensor_type, tuple(reversed(dims)), relative

    def _locate(self, name: str, raw_type: int, shape: tuple[int, ...], relative: int, data_start: int,
                alignment: int) -> GGUFTensor:
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise self.fail(f"tensor {name} has unknown type {raw_type}") from None
        if tensor_type not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
            raise CheckpointError(self._file.path, f"tensor {name} is {tensor_type.name}; supported: {supported}")
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        if 0 in shape:
            raise self.fail(f"tensor {name} has an empty dimension {shape}")
        if shape[-1] % block_size:
            raise self.fail(
                f"tensor {name}: row length {shape[-1]} is not a multiple of {tensor_type.name}'s block of {block_size}"
            )
        nbytes = math.prod(shape) // block_size * type_size
        offset = data_start + relative
        if relative % alignment or offset + nbytes > self._size:
            raise self.fail(
                f"tensor {name} ({nbytes} bytes at data offset {relative}) is misaligned or lies past the end of the file"
            )
        return GGUFTensor(name, tensor_type, shape, offset, nbytes)

