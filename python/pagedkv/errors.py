"""Exceptions raised by pagedkv.

Every error derives from :class:`PagedKVError` and also from the standard exception a caller would
naturally catch: unknown ids are ``KeyError``, bad arguments ``ValueError``, exhaustion
``RuntimeError``. An operation that raises has changed no state.
"""

from __future__ import annotations

__all__ = [
    "PagedKVError",
    "OutOfBlocksError",
    "UnknownSequenceError",
    "DuplicateSequenceError",
    "InvalidArgumentError",
    "ShapeError",
    "CheckpointError",
    "ModelError",
    "KvTierError",
    "InternalError",
]


class PagedKVError(Exception):
    """Base class of every pagedkv error."""


class OutOfBlocksError(PagedKVError, RuntimeError):
    """The KV block pool cannot supply the blocks an operation needs, even after eviction."""


class UnknownSequenceError(PagedKVError, KeyError):
    """No sequence or request has this id."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class DuplicateSequenceError(PagedKVError, ValueError):
    """A sequence or request with this id already exists."""


class InvalidArgumentError(PagedKVError, ValueError):
    """An argument is out of range or malformed (zero sizes, NaN, bad ids, impossible limits)."""


class ShapeError(InvalidArgumentError):
    """An array has the wrong shape or dtype."""


class ModelError(PagedKVError, RuntimeError):
    """The model gave a request nothing to sample from (NaN logits, or no token with a finite
    logit): that request fails alone, the others go on."""


class CheckpointError(PagedKVError, OSError):
    """A model checkpoint cannot be loaded: a file is missing, unreadable or malformed, or its
    tensors do not match its ``config.json``. The message names the offending file; ``path`` holds it.
    """

    def __init__(self, path: object, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = str(path)
        self.message = message

    def __str__(self) -> str:  # OSError would format (errno, strerror) pairs
        return str(self.args[0])

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # Rebuilt from both fields when it crosses processes (a Ray replica's failed load); the
        # default would call __init__ with the formatted message alone.
        return type(self), (self.path, self.message)


class KvTierError(PagedKVError, OSError):
    """The disk tier of the KV cache cannot be opened, read or written (its directory cannot be
    made, its files are locked by another engine, the disk failed). A block that merely fails
    verification is no error: it is dropped and recomputed."""

    def __str__(self) -> str:  # OSError would format (errno, strerror) pairs
        return str(self.args[0]) if self.args else ""


class NoChatTemplateError(PagedKVError, LookupError):
    """Chat was asked of a model whose tokenizer ships no chat template."""


class InternalError(PagedKVError, RuntimeError):
    """A bug in pagedkv: a call panicked inside the Rust core. The object it ran on refuses every
    later call with this error (its state may be half-changed); other objects are unaffected."""
