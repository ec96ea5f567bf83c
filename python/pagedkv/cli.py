"""Argument types shared by every ``python -m pagedkv`` subcommand.

Each function is an argparse ``type=``: it turns one command-line string into a value or raises
``argparse.ArgumentTypeError``, which argparse reports as a usage error (exit 2, the flag named,
no traceback) before any model, cache or trace is built. They check only what a value means on
its own (a count is positive, a port fits 16 bits, a path exists); limits that depend on other
arguments (a block budget against a model length, a thread count against the machine) stay with
the library, whose ``InvalidArgumentError`` ``pagedkv.__main__`` reports the same way.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable, Sequence, TypeVar

__all__ = [
    "positive_int",
    "non_negative_int",
    "port",
    "positive_float",
    "non_negative_float",
    "existing_file",
    "model_source",
    "trace_source",
    "output_dir",
    "comma_list",
    "one_of",
]

T = TypeVar("T")
MAX_PORT = 65535


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def _float(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer ≥ 1 (a count or a size)."""
    value = _int(text, "an integer ≥ 1")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer ≥ 1, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An integer ≥ 0 (a seed, a threshold, a count where 0 means none)."""
    value = _int(text, "an integer ≥ 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer ≥ 0, got {text!r}")
    return value


def port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    value = _int(text, f"a port in [0, {MAX_PORT}]")
    if not 0 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"expected a port in [0, {MAX_PORT}], got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (a rate, a speed-up)."""
    value = _float(text, "a finite number > 0")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number ≥ 0 (a duration, where 0 means at once)."""
    value = _float(text, "a finite number ≥ 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number ≥ 0, got {text!r}")
    return value


def existing_file(text: str) -> Path:
    """A path to an existing regular file."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file" if path.exists() else f"{text!r} does not exist")
    return path


def model_source(text: str) -> str:
    """``tiny`` (the built-in model) or an existing checkpoint directory."""
    if text != "tiny":
        path = Path(text)
        if not path.is_dir():
            reason = "is not a directory" if path.exists() else "does not exist"
            raise argparse.ArgumentTypeError(f"{text!r} {reason} (expected 'tiny' or a checkpoint directory)")
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
    """A directory to write into: an existing one, or a path where one can be created."""
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


def comma_list(item: Callable[[str], T]) -> Callable[[str], tuple[T, ...]]:
    """A non-empty comma-separated list, each item parsed by ``item``, without repeats."""

    def parse(text: str) -> tuple[T, ...]:
        values = tuple(item(part.strip()) for part in text.split(","))
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"repeated item in {text!r}")
        return values

    return parse
