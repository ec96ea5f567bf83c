"""Models: the Llama and Gemma 3 decoders running on the paged KV cache, their configs and
parameter schema, the step they read, a dense reference (the test oracle) and a simulated model
for large runs.

One concept per module: :mod:`~pagedkv.models.decoder` (what every paged decoder shares),
:mod:`~pagedkv.models.layers` (norms, activations, packed projections),
:mod:`~pagedkv.models.gemma3` (:class:`Gemma3Config`, :class:`Gemma3Model`),
:mod:`~pagedkv.models.config` (:class:`LlamaConfig`),
:mod:`~pagedkv.models.weights` (the parameters and their schema), :mod:`~pagedkv.models.rope`,
:mod:`~pagedkv.models.step`, :mod:`~pagedkv.models.llama`, :mod:`~pagedkv.models.reference`,
:mod:`~pagedkv.models.simulated`. Loading them from files is :mod:`pagedkv.loaders`.
"""

from __future__ import annotations

from pagedkv.models.config import LlamaConfig, RopeScaling
from pagedkv.models.decoder import PagedDecoder
from pagedkv.models.gemma3 import Gemma3Config, Gemma3Model
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
    "Gemma3Config",
    "Gemma3Model",
    "LayerWeights",
    "LlamaConfig",
    "LlamaModel",
    "LlamaWeights",
    "ModelStep",
    "PagedDecoder",
    "RopeScaling",
    "SimulatedModel",
    "StepArrays",
    "StepCostModel",
]
