"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest

from pagedkv.models import LlamaConfig, LlamaWeights


@pytest.fixture(scope="module")
def weights() -> LlamaWeights:
    """The tiny model's seeded random weights."""
    return LlamaWeights.random(LlamaConfig.tiny(), seed=0)
