"""Loading models from files: Hugging Face checkpoint directories, GGUF files, their tokenizers
and generation defaults, and registered models by name.

One concept per module: :mod:`~pagedkv.loaders.files` (safe opening of checkpoint files),
:mod:`~pagedkv.loaders.checkpoint` (``config.json`` + safetensors), :mod:`~pagedkv.loaders.gguf_file`
(the GGUF format), :mod:`~pagedkv.loaders.gguf` (Llama from GGUF), :mod:`~pagedkv.loaders.tokenizers`,
:mod:`~pagedkv.loaders.generation_config`, :mod:`~pagedkv.loaders.identity` (what a KV cache was
computed by), :mod:`~pagedkv.loaders.registry` (models by name or path).
"""

from __future__ import annotations

from pagedkv.loaders.checkpoint import load_checkpoint, load_config, save_checkpoint, stream_checkpoint
from pagedkv.loaders.registry import REGISTRY, load_model, load_pretrained
from pagedkv.loaders.tokenizers import load_tokenizer

__all__ = [
    "REGISTRY",
    "load_checkpoint",
    "load_config",
    "load_model",
    "load_pretrained",
    "load_tokenizer",
    "save_checkpoint",
    "stream_checkpoint",
]
