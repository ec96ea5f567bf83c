"""Streamed text: :class:`IncrementalDetokenizer` turns one sample's tokens into text deltas,
:class:`StopStringMatcher` cuts that text at the first stop string, and :class:`SampleText` chains
the two for one sample.

The detokenizer decodes a bounded window of the latest tokens, never the whole output (the
prefix-offset technique of incremental detokenizers, e.g. vLLM's and TGI's). Its model of a
decode: the text of tokens is the lossy UTF-8 decoding of their concatenated bytes (special tokens
have none), an incomplete sequence at the end rendered as U+FFFD (one, as byte-level BPE and
:class:`~pagedkv.model.tokenizer.ByteTokenizer` do, or one per byte, as a byte-fallback decoder
does) until it completes; except that the window's first token may render differently (a
tokenizer may strip its leading space), which the window's context tokens absorb.

Invariants of :class:`IncrementalDetokenizer` (``tokens`` are those pushed, ``decode`` the
tokenizer's):

- ``emitted`` chars of ``decode(tokens[start:])`` have been delivered, and the deltas delivered so
  far, concatenated, equal ``decode(tokens)`` minus its last ``len(decode(tokens[start:])) -
  emitted`` chars; after :meth:`finish`, all of ``decode(tokens)``.
- Only a trailing run of U+FFFD is held back: in that model, no other char changes when tokens
  follow.
- ``start`` moves only at a point where both the old and the new window decode to text not ending
  in U+FFFD: the decoder is then between characters in both, so later bytes decode alike.
- Each push decodes ``tokens[start:]`` once, and a window move decodes once more; the window moves
  whenever it exceeds ``2 * context`` tokens at such a point, so a push costs O(context) amortized.
  (Only a run of tokens each leaving the text ending in U+FFFD — invalid UTF-8 — keeps it growing.)

Invariants of :class:`StopStringMatcher`: until a stop string completes, it has delivered all the
text pushed but its longest suffix that is a proper prefix of a stop string (held: it may still
become one), so no stop string can begin in the delivered text; the earliest occurrence of any
stop string ends the text before it. Each push searches only the held suffix (shorter than the
longest stop string) plus the new delta.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedkv.model.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "SampleText", "StopStringMatcher"]

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas of one token stream (see the module doc for the invariants)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], context: int = 4) -> None:
        self._decode = decode
        self._context = context
        self.tokens: list[int] = []
        self._start = 0  # the window is tokens[start:]
        self._emitted = 0  # chars of decode(tokens[start:]) already delivered

    def push(self, token_id: int) -> str:
        """Adds one token; returns the text it completes (possibly empty)."""
        self.tokens.append(token_id)
        text = self._decode(self.tokens[self._start:])
        final = len(text.rstrip(_REPLACEMENT))
        delta = text[self._emitted:final]
        self._emitted = max(self._emitted, final)
        if final == len(text) and len(self.tokens) - self._start > 2 * self._context:
            self._move_window()
        return delta

    def finish(self) -> str:
        """The held-back tail (U+FFFD only); the stream is then complete."""
        delta = self._decode(self.tokens[self._start:])[self._emitted:]
        self._emitted += len(delta)
        return delta

    def _move_window(self) -> None:
        """Shrinks the window to the last ``context`` tokens, everything in it delivered, if the
        shorter window also decodes to text not ending in U+FFFD (else it stays: correct, longer)."""
        start = len(self.tokens) - self._context
        text = self._decode(self.tokens[start:])
        if not text.endswith(_REPLACEMENT):
            self._start, self._emitted = start, len(text)


class StopStringMatcher:
    """Cuts a text stream at the first occurrence of any of ``stops`` (non-empty strings)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._held = ""  # delivered to no one yet: a suffix that may start a stop string
        self.stopped = False

    def push(self, delta: str) -> str:
        """The text of ``delta`` that can be delivered now; sets :attr:`stopped` when a stop string
        completes (what follows it is dropped, and so is every later push)."""
        if self.stopped:
            return ""
        text = self._held + delta
        hits = [i for i in (text.find(stop) for stop in self._stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[: min(hits)]
        keep = self._partial_stop(text)
        self._held = text[len(text) - keep:]
        return text[: len(text) - keep]

    def finish(self) -> str:
        """The held suffix (the stream ended without completing a stop string)."""
        held, self._held = self._held, ""
        return held

    def _partial_stop(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for length in range(min(len(text), max(len(s) for s in self._stops) - 1), 0, -1):
            suffix = text[-length:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return length
        return 0


class SampleText:
    """One sample's text so far: its :class:`IncrementalDetokenizer`, then its :class:`StopStringMatcher`
    (if it has stop strings). The engine core and the cluster's front end both build a sample's text
    with it."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str]) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer.decode)
        self.matcher = StopStringMatcher(stop) if stop else None

    def push(self, token_id: int, last: bool) -> str:
        """The text ``token_id`` adds (all that is held too when ``last``: the sample ends)."""
        delta = self._cut(self.detokenizer.push(token_id))
        if last and not self.stopped:
            delta += self._cut(self.detokenizer.finish())
            if self.matcher is not None and not self.matcher.stopped:
                delta += self.matcher.finish()
        return delta

    def _cut(self, delta: str) -> str:
        return delta if self.matcher is None else self.matcher.push(delta)

    @property
    def stopped(self) -> bool:
        """Whether a stop string has completed."""
        return self.matcher is not None and self.matcher.stopped
