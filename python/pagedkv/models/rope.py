"""Rotary position embedding's frequencies: those a :class:`LlamaConfig` implies
(:func:`rope_frequencies`, with its linear or llama3 scaling). The rotation itself is the core's
(``pagedkv._core.Decoder``), which computes the angles per step for the positions the step holds,
so no table is sized by ``max_position_embeddings`` (millions for some checkpoints).

Invariants: frequencies are computed in float64 in one place, shared by the paged model and the
dense reference.
"""

from __future__ import annotations

import numpy as np

from pagedkv.models.config import LlamaConfig

__all__ = ["inverse_frequencies", "rope_frequencies"]


def inverse_frequencies(theta: float, head_dim: int) -> np.ndarray:
    """float64 ``[head_dim // 2]``: frequency ``i`` turns by ``theta ** (-2i / head_dim)`` radians
    per position (plain rotary embedding)."""
    return theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def rope_frequencies(config: LlamaConfig) -> np.ndarray:
    """float64 ``[head_dim // 2]``: :func:`inverse_frequencies` of the config's ``rope_theta``,
    rescaled by ``config.rope_scaling`` as transformers does."""
    inv_freq = inverse_frequencies(config.rope_theta, config.head_dim)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: by wavelength (positions per turn) against the pretraining context.
    original = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    assert original is not None and low is not None and high is not None  # RopeScaling checked them
    wavelength = 2.0 * np.pi / inv_freq
    # 0 where the frequency is divided by factor, 1 where it is kept, linear in turns per context between.
    keep = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)
    return inv_freq * (keep + (1.0 - keep) / scaling.factor)
