"""Text ↔ token ids: :class:`HFTokenizer` (the ``tokenizers`` package; built from a checkpoint's
``tokenizer.json`` or a GGUF file's vocabulary by :mod:`pagedkv.loaders.tokenizers`), else
:class:`ByteTokenizer`, which needs no files and fits the tiny model's vocabulary.

An :class:`HFTokenizer` also carries what chat needs (:mod:`pagedkv.text.chat`): its chat
template and the text of its bos and eos tokens. The byte tokenizer has no template. This module
reads no file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any, Protocol

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer"]


class Tokenizer(Protocol):
    """What the engine needs from a tokenizer."""

    chat_template: str | None  # the Jinja chat template, None for a tokenizer without one
    bos_token: str  # the text a chat template writes for the bos token ("" if unknown)
    eos_token: str  # and for the eos token

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce."""
        ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, with the beginning-of-sequence token if the tokenizer adds one
        (and ``add_special_tokens``: a chat template writes it itself)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens left out."""
        ...

    def token_bytes(self) -> tuple[list[bytes], list[bool]]:
        """Each id's bytes of text, and whether it is special (stands for no text): what a grammar
        (:class:`pagedkv._core.Vocabulary`) matches outputs against."""
        ...

    @property
    def max_token_chars(self) -> int:
        """The most characters of text one token stands for: a text of ``c`` characters has at
        least ``c / max_token_chars`` tokens (what refuses an overlong prompt before encoding it)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: byte ``b`` is id ``b + 3``; ids 0, 1, 2 are padding,
    beginning and end of sequence. ``encode`` prepends the BOS id. Ids past the byte range (which
    a random model may emit) decode to U+FFFD, like invalid UTF-8."""

    PAD_ID = 0
    BOS_ID = 1
    EOS_ID = 2
    _OFFSET = 3
    chat_template: str | None = None
    bos_token = eos_token = ""

    @property
    def vocab_size(self) -> int:
        """259: three special ids and 256 bytes."""
        return self._OFFSET + 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``[BOS]`` (if ``add_special_tokens``) followed by one id per UTF-8 byte."""
        return [self.BOS_ID] * add_special_tokens + [b + self._OFFSET for b in text.encode("utf-8")]

    @property
    def max_token_chars(self) -> int:
        """1: a token is one byte of the text."""
        return 1

    def token_bytes(self) -> tuple[list[bytes], list[bool]]:
        """Ids 0-2 special (named as written), then one byte each."""
        names = [b"<pad>", b"<s>", b"</s>"]
        return names + [bytes([b]) for b in range(256)], [True] * self._OFFSET + [False] * 256

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
    """A tokenizer of the ``tokenizers`` package: read from a Hugging Face ``tokenizer.json``
    (:func:`~pagedkv.loaders.tokenizers.tokenizer_from_file`) or built from a GGUF file's vocabulary
    (:func:`~pagedkv.loaders.tokenizers.tokenizer_from_gguf_metadata`).
    ``path`` is the file it came from; ``chat_template`` the Jinja chat template shipped with it,
    if any; ``bos_token`` and ``eos_token`` the text of those tokens (what a template writes for
    them; "" if unknown)."""

    def __init__(self, tokenizer: Any, path: Path, chat_template: str | None = None,
                 bos_token: str = "", eos_token: str = "") -> None:
        self._tokenizer = tokenizer
        self._max_token_chars: int | None = None
        self.path = path
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token

    @property
    def vocab_size(self) -> int:
        """Vocabulary size, added tokens included."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text``, with the special tokens the tokenizer's template adds (e.g. BOS) if
        ``add_special_tokens``. Special tokens written in ``text`` are matched whole either way.
        Other threads run meanwhile: ``encode_batch`` releases the GIL where ``encode`` holds it
        (measured: a 6 MB text, 4.5 s, let a waiting thread wake once; through ``encode_batch``,
        6,105 times)."""
        (encoding,) = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    @property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry, added tokens included (a byte-level entry has one
        character per byte, at least as many as the text it stands for); computed once."""
        if self._max_token_chars is None:
            self._max_token_chars = max(map(len, self._tokenizer.get_vocab(with_added_tokens=True)), default=1)
        return self._max_token_chars

    def token_bytes(self) -> tuple[list[bytes], list[bool]]:
        """Read from the vocabulary through the tokenizer's decoder: a byte-level one (GPT-2's,
        SmolLM2's) maps each character of an entry back to its byte; otherwise (SentencePiece,
        Gemma's) "▁" is a space and ``<0xXX>`` a byte. Special added tokens are their names."""
        spec = json.loads(self._tokenizer.to_str())
        special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        added = {t["id"] for t in spec.get("added_tokens", [])}
        byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
        words, flags = [b""] * self.vocab_size, [False] * self.vocab_size
        for piece, token in self._tokenizer.get_vocab(with_added_tokens=True).items():
            flags[token] = token in special
            if token in added:
                words[token] = piece.encode()
            elif byte_level:
                table = _byte_level_bytes()
                words[token] = bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode()
            elif byte := _BYTE_PIECE.fullmatch(piece):
                words[token] = bytes([int(byte.group(1), 16)])
            else:
                words[token] = piece.replace("\u2581", " ").encode()
        return words, flags

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` with special tokens skipped."""
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def save(self, directory: Path) -> None:
        """Writes the tokenizer as a Hugging Face tokenizer directory (``tokenizer.json`` and a
        ``tokenizer_config.json`` with its special tokens and chat template), which transformers'
        ``AutoTokenizer`` loads: what clients that count tokens themselves (lm-eval, guidellm)
        are given for a model read from a GGUF file."""
        directory.mkdir(parents=True, exist_ok=True)
        self._tokenizer.save(str(directory / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": self.bos_token or None,
                  "eos_token": self.eos_token or None, "chat_template": self.chat_template}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


@cache
def _byte_level_bytes() -> dict[str, int]:
    """The byte-level tokenizers' character for each byte, inverted: printable Latin-1 bytes stand
    for themselves, the other 68 for the characters from U+0100 on, in byte order (GPT-2's map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}
