"""The pieces decoders share as they are built: packing a projection into the Rust linear kernel
(:func:`packed_linear`, :func:`fused_linear`), a weight kept as a GGUF file ships it
(:class:`QuantizedTensor`) and the table token embeddings are gathered from
(:func:`embedding_of`). The arithmetic of the forward pass is the core's (``pagedkv._core.Decoder``).

Invariants: :func:`packed_linear` refuses
a weight that its storage type would turn into infinity, so no model packs a silent overflow; a
quantized tensor is packed quantized only under ``weight_dtype="auto"`` and is dequantized
(bit-exactly as ggml does) for any other storage type.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagedkv._core import Embedding, Linear
from pagedkv.errors import InvalidArgumentError

__all__ = ["packed_linear", "fused_linear", "check_weight_dtype",
           "canonical_weight_dtype", "float_tensor", "QuantizedTensor", "Tensor", "embedding_of", "AUTO_WEIGHT_DTYPE",
           "AUTO_DENSE_DTYPE"]

AUTO_WEIGHT_DTYPE = "auto"
"""Keeps a GGUF file's quantized projections as shipped; other tensors take :data:`AUTO_DENSE_DTYPE`."""

AUTO_DENSE_DTYPE = "float16"
"""The storage of a float tensor under ``"auto"``: the loaders' default (``DEFAULT_WEIGHT_DTYPE``)."""


@dataclass(frozen=True)
class QuantizedTensor:
    """A 2-D weight as a GGUF file ships it: ``rows`` are its uint8 bytes ``[out, row bytes]`` in
    ``format`` ("q8_0", "q4_0", "q4_1", "q5_0", "q4_k" or "q6_k"); ``shape`` is ``(out, in)``, the
    float tensor's numpy shape."""

    format: str
    shape: tuple[int, ...]
    rows: np.ndarray

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized rows."""
        return int(self.rows.nbytes)

    def linear(self) -> Linear:
        """The weight as a quantized :class:`~pagedkv._core.Linear` (``y = x @ self.T``)."""
        return Linear.quantized(self.shape[1], [(self.format, self.rows)])

    def dequantize(self) -> np.ndarray:
        """The float32 values, bit-exactly as ggml dequantizes them."""
        return self.linear().dequantize_rows(np.arange(self.shape[0], dtype=np.int64))


Tensor = np.ndarray | QuantizedTensor
"""A tensor as the loaders stream it: float32 values, or a GGUF projection kept quantized."""


def canonical_weight_dtype(weight_dtype: str) -> str:
    """``weight_dtype``'s canonical name: "auto", or the float storage type ``Linear`` names it
    ("bf16" -> "bfloat16"). Raises :class:`InvalidArgumentError` for anything else, so a load can
    fail before it reads anything. ``Linear`` itself is the one validator of float types: a 1 × 1
    weight asks it."""
    if weight_dtype == AUTO_WEIGHT_DTYPE:
        return weight_dtype
    try:
        return Linear(np.zeros((1, 1), np.float32), weight_dtype).dtype
    except InvalidArgumentError as error:
        raise InvalidArgumentError(f"weight_dtype: {error} (or {AUTO_WEIGHT_DTYPE!r})") from None


def check_weight_dtype(weight_dtype: str) -> None:
    """Raises :class:`InvalidArgumentError` unless ``weight_dtype`` is "auto" or a float type
    ``Linear`` stores ("float32", "float16", "bfloat16" or an alias such as "bf16")."""
    canonical_weight_dtype(weight_dtype)


def packed_linear(out_in: Tensor, weight_dtype: str, name: str) -> Linear:
    """An ``[out, in]`` matrix packed, a float one read through its ``.T`` (Fortran-ordered: no
    copy); a :class:`QuantizedTensor` stays quantized under "auto". Raises
    :class:`InvalidArgumentError` if float16 storage would turn a weight into infinity."""
    return fused_linear([out_in], weight_dtype, name)


def fused_linear(parts: Sequence[Tensor], weight_dtype: str, name: str) -> Linear:
    """``[out, in]`` matrices stacked along ``out`` into one projection (``[q|k|v]``). Under "auto"
    quantized parts stay quantized, each in its own format, when every part is quantized;
    otherwise the parts are float32 (dequantized if need be) packed as ``weight_dtype`` (under
    "auto": :data:`AUTO_DENSE_DTYPE`)."""
    if weight_dtype == AUTO_WEIGHT_DTYPE and all(isinstance(p, QuantizedTensor) for p in parts):
        quantized = [p for p in parts if isinstance(p, QuantizedTensor)]
        return Linear.quantized(quantized[0].shape[1], [(p.format, p.rows) for p in quantized])
    arrays = [p.dequantize() if isinstance(p, QuantizedTensor) else p for p in parts]
    out_in = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
    storage = AUTO_DENSE_DTYPE if weight_dtype == AUTO_WEIGHT_DTYPE else weight_dtype
    linear = Linear(out_in.T, storage)
    # max and -min, not abs(): no temporary the size of the tensor during a streamed load.
    if linear.dtype == "float16" and max(float(out_in.max()), -float(out_in.min())) >= _F16_OVERFLOW:
        raise InvalidArgumentError(f"{name} holds weights beyond float16's range: use bfloat16 or float32 weights")
    return linear


# The smallest magnitude float16 rounds to infinity (65504 is its largest finite value).
_F16_OVERFLOW = 65520.0


def float_tensor(tensor: Tensor, name: str) -> np.ndarray:
    """A tensor the forward pass reads as float32 values (a norm); raises
    :class:`InvalidArgumentError` for a quantized one."""
    if isinstance(tensor, QuantizedTensor):
        raise InvalidArgumentError(f"{name} must be a float tensor, got {tensor.format}")
    return tensor


def embedding_of(tensor: Tensor, lm_head: Linear | None = None) -> tuple[Embedding, int]:
    """The token embedding of a streamed tensor and the bytes it adds to the model: the float32
    table (copied into the core: build it as the tensor arrives, then drop the array), or, for a
    quantized tensor, its rows dequantized on gather, so no float32 table is held: ``lm_head``'s
    own (0 bytes added) when it is the tied output projection kept in the same format."""
    if isinstance(tensor, QuantizedTensor):
        if lm_head is not None and lm_head.dtype == tensor.format:
            return Embedding(lm_head), 0
        embedding = Embedding(tensor.linear())
    else:
        embedding = Embedding(tensor)
    return embedding, embedding.nbytes
