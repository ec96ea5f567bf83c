"""One array in every memory layout a caller can hand the bindings: tests compare what a binding
makes of each with what it makes of the C-ordered array, so an argument read in memory order (or
with the wrong strides) cannot pass."""

from __future__ import annotations

import numpy as np


def layouts(array: np.ndarray) -> dict[str, np.ndarray]:
    """Arrays equal to ``array`` element by element, each laid out differently in memory."""
    array = np.ascontiguousarray(array)
    buffer = np.empty(array.nbytes + 1, np.uint8)
    unaligned = buffer[1:].view(array.dtype).reshape(array.shape)
    unaligned[...] = array
    variants = {
        "fortran": np.asfortranarray(array),
        "strided": np.repeat(array, 2, axis=-1)[..., ::2],
        "reversed": array[::-1].copy()[::-1],
        "unaligned": unaligned,
    }
    for name, variant in variants.items():
        assert np.array_equal(variant, array) and variant.dtype == array.dtype, name
    assert not variants["strided"].flags.c_contiguous and not variants["reversed"].flags.c_contiguous
    assert array.ndim < 2 or not variants["fortran"].flags.c_contiguous
    assert array.dtype.alignment == 1 or not unaligned.flags.aligned
    return variants
