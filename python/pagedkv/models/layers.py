"""The pieces decoders share: RMSNorm, the activations, and packing a projection into the Rust
linear kernel (:func:`packed_linear`).

Invariants: every function computes in float32 and returns float32; :func:`packed_linear` refuses
a weight that its storage type would turn into infinity, so no model packs a silent overflow.
"""

from __future__ import annotations

import numpy as np

from pagedkv._core import Linear
from pagedkv.errors import InvalidArgumentError

__all__ = ["rms_norm", "silu", "gelu_tanh", "packed_linear", "check_weight_dtype"]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last axis, in float32."""
    mean_square = np.mean(np.square(x), axis=-1, keepdims=True)
    return x * (1.0 / np.sqrt(mean_square + np.float32(eps))) * weight


def silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)`` in float32, written with tanh so no input overflows."""
    return x * (np.float32(0.5) + np.float32(0.5) * np.tanh(np.float32(0.5) * x))


_SQRT_2_OVER_PI = np.float32(np.sqrt(2.0 / np.pi))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU in its tanh approximation (PyTorch's ``gelu(approximate="tanh")``, Gemma's
    ``gelu_pytorch_tanh``): ``x/2 · (1 + tanh(√(2/π) (x + 0.044715 x³)))``, in float32."""
    inner = _SQRT_2_OVER_PI * (x + np.float32(0.044715) * x * x * x)
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner))


def check_weight_dtype(weight_dtype: str) -> None:
    """Raises :class:`InvalidArgumentError` unless ``Linear`` stores ``weight_dtype`` ("float32",
    "float16", "bfloat16" or an alias such as "bf16"), so a load can fail before it reads
    anything. ``Linear`` itself is the one validator: a 1 × 1 weight asks it."""
    Linear(np.zeros((1, 1), np.float32), weight_dtype)


def packed_linear(out_in: np.ndarray, weight_dtype: str, name: str) -> Linear:
    """An ``[out, in]`` matrix packed, read through its ``.T`` (Fortran-ordered: no copy). Raises
    :class:`InvalidArgumentError` if float16 storage would turn a weight into infinity."""
    linear = Linear(out_in.T, weight_dtype)
    # max and -min, not abs(): no temporary the size of the tensor during a streamed load.
    if linear.dtype == "float16" and max(float(out_in.max()), -float(out_in.min())) >= _F16_OVERFLOW:
        raise InvalidArgumentError(f"{name} holds weights beyond float16's range: use bfloat16 or float32 weights")
    return linear


# The smallest magnitude float16 rounds to infinity (65504 is its largest finite value).
_F16_OVERFLOW = 65520.0
