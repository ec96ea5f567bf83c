"""Text ↔ token ids: a checkpoint's ``tokenizer.json`` (via the ``tokenizers`` package) when it has
one, else :class:`ByteTokenizer`, which needs no files and fits the tiny model's vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, Sequence, Union

from pagedkv.errors import CheckpointError, InvalidArgumentError
from pagedkv.model.files import CheckpointFile, is_present

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "load_tokenizer", "TOKENIZER_FILE"]

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer(Protocol):
    """What the engine needs from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with the beginning-of-sequence token if the tokenizer adds one."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens left out."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: byte ``b`` is id ``b + 3``; ids 0, 1, 2 are padding,
    beginning and end of sequence. ``encode`` prepends the BOS id. Ids past the byte range (which
    a random model may emit) decode to U+FFFD, like invalid UTF-8."""

    PAD_ID = 0
    BOS_ID = 1
    EOS_ID = 2
    _OFFSET = 3

    @property
    def vocab_size(self) -> int:
        """259: three special ids and 256 bytes."""
        return self._OFFSET + 256

    def encode(self, text: str) -> list[int]:
        """``[BOS]`` followed by one id per UTF-8 byte."""
        return [self.BOS_ID, *(b + self._OFFSET for b in text.encode("utf-8"))]

    def decode(self, token_ids: Sequence[int]) -> str:
        """The UTF-8 text of the byte ids, special ids skipped; invalid bytes become U+FFFD."""
        out = bytearray()
        for token in token_ids:
            if token >= self.vocab_size:
                out += "\ufffd".encode("utf-8")
            elif token >= self._OFFSET:
                out.append(token - self._OFFSET)
        return out.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (any model the ``tokenizers`` package reads)."""

    def __init__(self, file: Union[str, Path, CheckpointFile]) -> None:
        """Loads ``file``: a :class:`CheckpointFile`, or a path, which must be a regular file
        inside its own directory."""
        from tokenizers import Tokenizer as _Tokenizer

        if not isinstance(file, CheckpointFile):
            file = CheckpointFile.locate(Path(file).parent, Path(file).name)
        self.path = file.path
        text = file.read_text()
        try:
            self._tokenizer = _Tokenizer.from_str(text)
        except Exception as error:  # the tokenizers package raises a bare Exception on bad files
            raise CheckpointError(self.path, f"cannot load tokenizer: {error}") from error

    @property
    def vocab_size(self) -> int:
        """Vocabulary size, added tokens included."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` with the special tokens the tokenizer's template adds (e.g. BOS)."""
        return list(self._tokenizer.encode(text, add_special_tokens=True).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` with special tokens skipped."""
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=True))


def load_tokenizer(checkpoint_dir: Union[str, Path, None], vocab_size: int) -> Tokenizer:
    """The tokenizer for a model of ``vocab_size`` ids: ``checkpoint_dir/tokenizer.json`` if the
    directory has that entry, else a :class:`ByteTokenizer`. Raises :class:`CheckpointError` when
    the entry is not a regular file inside the directory or not a tokenizer, and
    :class:`InvalidArgumentError` when the chosen tokenizer produces ids the model does not have."""
    tokenizer: Tokenizer
    directory = Path(checkpoint_dir) if checkpoint_dir is not None else None
    if directory is not None and is_present(directory, TOKENIZER_FILE):
        tokenizer = HFTokenizer(CheckpointFile.locate(directory, TOKENIZER_FILE))
    else:
        tokenizer = ByteTokenizer()
    if tokenizer.vocab_size > vocab_size:
        source = tokenizer.path if isinstance(tokenizer, HFTokenizer) else "the byte tokenizer"
        raise InvalidArgumentError(f"{source} has {tokenizer.vocab_size} ids but the model only {vocab_size}")
    return tokenizer
