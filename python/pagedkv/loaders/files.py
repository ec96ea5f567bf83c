"""The files of a checkpoint directory, opened only when they are safe to open: :class:`CheckpointFile`.

Invariants: a :class:`CheckpointFile` names a regular file that lies inside its checkpoint
directory once every symlink is resolved; names that are absolute or climb out with ``..`` are
refused before anything is touched. Files are opened non-blocking and checked again on the open
descriptor, so a FIFO or device swapped in after the check never blocks a read. Every refusal is a
:class:`CheckpointError` naming the file as the checkpoint names it.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from pagedkv.errors import CheckpointError

__all__ = ["CheckpointFile", "is_present"]


def is_present(directory: Path, name: str) -> bool:
    """Whether ``directory`` holds an entry ``name`` of any kind (a dangling symlink or a FIFO
    counts: an optional file that is present but unusable must be refused, not skipped)."""
    return os.path.lexists(directory / name)


@dataclass(frozen=True)
class CheckpointFile:
    """A regular file inside a checkpoint directory. ``path`` is how the checkpoint names it
    (what errors show); ``real`` is that path with every symlink resolved."""

    path: Path
    real: Path

    @classmethod
    def locate(cls, directory: Path, name: str, named_by: str | None = None) -> CheckpointFile:
        """``directory/name``, refused unless it is a regular file inside ``directory``.
        ``named_by`` (a file name) says where the name came from, for the error message."""
        source = f" (named by {named_by})" if named_by else ""
        path = directory / name
        relative = PurePosixPath(name)
        if not name or "\0" in name or relative.is_absolute() or ".." in relative.parts:
            raise CheckpointError(path, f"refused: not a file name inside the checkpoint directory{source}")
        try:
            root, real = directory.resolve(), path.resolve()
        except (OSError, RuntimeError) as error:  # RuntimeError: a symlink loop (Python < 3.13)
            raise CheckpointError(path, f"cannot resolve: {error}") from None
        if not real.is_relative_to(root):
            raise CheckpointError(path, f"refused: resolves to {real}, outside the checkpoint directory {root}{source}")
        try:
            mode = os.stat(real).st_mode
        except FileNotFoundError:
            raise CheckpointError(path, f"file not found{source}") from None
        except OSError as error:
            raise CheckpointError(path, f"cannot read: {error}") from error
        if not stat.S_ISREG(mode):
            raise CheckpointError(path, f"refused: not a regular file{source}")
        return cls(path, real)

    def open(self) -> BinaryIO:
        """The file opened for binary reading. O_NONBLOCK keeps a FIFO swapped in since
        :meth:`locate` from blocking, and O_NOFOLLOW a symlink swapped in from being followed;
        the descriptor is checked again to be a regular file."""
        flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.real, flags)
        except OSError as error:
            raise CheckpointError(self.path, f"cannot read: {error}") from error
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CheckpointError(self.path, "refused: not a regular file")
        return os.fdopen(fd, "rb")

    def read_bytes(self) -> bytes:
        """The whole file."""
        with self.open() as file:
            try:
                return file.read()
            except OSError as error:
                raise CheckpointError(self.path, f"cannot read: {error}") from error

    def read_text(self) -> str:
        """The whole file as UTF-8 text."""
        try:
            return self.read_bytes().decode("utf-8")
        except UnicodeDecodeError as error:
            raise CheckpointError(self.path, f"not UTF-8 text: {error}") from None

    def read_json(self) -> object:
        """The parsed JSON content."""
        try:
            return json.loads(self.read_text())
        except ValueError as error:  # JSONDecodeError, or an integer literal past Python's digit limit
            raise CheckpointError(self.path, f"malformed JSON: {error}") from error
        except RecursionError:
            raise CheckpointError(self.path, "malformed JSON: nested too deeply") from None
