"""The model side of pagedkv: a Llama decoder running on the paged KV cache, its checkpoints,
sampling, tokenizers, a dense reference (the test oracle) and a simulated model for large runs.

One concept per module: :mod:`~pagedkv.model.config`, :mod:`~pagedkv.model.files` (safe opening of
checkpoint files), :mod:`~pagedkv.model.weights` (Hugging Face checkpoints),
:mod:`~pagedkv.model.gguf_file` (the GGUF format), :mod:`~pagedkv.model.gguf` (Llama from GGUF),
:mod:`~pagedkv.model.pretrained` (models by name or path: :func:`load_pretrained`, :func:`load_model`),
:mod:`~pagedkv.model.rope`,
:mod:`~pagedkv.model.step`, :mod:`~pagedkv.model.llama`, :mod:`~pagedkv.model.reference`,
:mod:`~pagedkv.model.sampling`, :mod:`~pagedkv.model.tokenizer`, :mod:`~pagedkv.model.simulated`.
"""

from __future__ import annotations

from pagedkv.model.config import LlamaConfig, RopeScaling
from pagedkv.model.llama import DEFAULT_WEIGHT_DTYPE, WEIGHT_DTYPES, LlamaModel
from pagedkv.model.pretrained import REGISTRY, load_model, load_pretrained
from pagedkv.model.reference import DenseReference
from pagedkv.model.sampling import SamplingParams, sample
from pagedkv.model.simulated import SimulatedModel, StepCostModel
from pagedkv.model.step import ModelStep
from pagedkv.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from pagedkv.model.weights import LayerWeights, LlamaWeights, load_checkpoint, load_config, save_checkpoint

__all__ = [
    "LlamaConfig",
    "RopeScaling",
    "LlamaWeights",
    "LayerWeights",
    "load_config",
    "load_checkpoint",
    "save_checkpoint",
    "load_pretrained",
    "load_model",
    "REGISTRY",
    "ModelStep",
    "LlamaModel",
    "DEFAULT_WEIGHT_DTYPE",
    "WEIGHT_DTYPES",
    "DenseReference",
    "SamplingParams",
    "sample",
    "Tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "SimulatedModel",
    "StepCostModel",
]
