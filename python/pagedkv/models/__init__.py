"""Models: the Llama decoder running on the paged KV cache, its config and parameter schema, the
step it reads, a dense reference (the test oracle) and a simulated model for large runs.

One concept per module: :mod:`~pagedkv.models.config` (:class:`LlamaConfig`),
:mod:`~pagedkv.models.weights` (the parameters and their schema), :mod:`~pagedkv.models.rope`,
:mod:`~pagedkv.models.step`, :mod:`~pagedkv.models.llama`, :mod:`~pagedkv.models.reference`,
:mod:`~pagedkv.models.simulated`. Loading them from files is :mod:`pagedkv.loaders`.
"""

from __future__ import annotations

from pagedkv.models.config import LlamaConfig, RopeScaling
from pagedkv.models.llama import DEFAULT_WEIGHT_DTYPE, WEIGHT_DTYPES, LlamaModel
from pagedkv.models.reference import DenseReference
from pagedkv.models.simulated import SimulatedModel, StepCostModel
from pagedkv.models.step import CacheStep, ModelStep, StepArrays
from pagedkv.models.weights import LayerWeights, LlamaWeights

__all__ = [
    "CacheStep",
    "DEFAULT_WEIGHT_DTYPE",
    "WEIGHT_DTYPES",
    "DenseReference",
    "LayerWeights",
    "LlamaConfig",
    "LlamaModel",
    "LlamaWeights",
    "ModelStep",
    "RopeScaling",
    "SimulatedModel",
    "StepArrays",
    "StepCostModel",
]
