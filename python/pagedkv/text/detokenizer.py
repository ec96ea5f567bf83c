"""Streamed text: :class:`IncrementalDetokenizer` turns one sample's tokens into text deltas,
:class:`StopStringMatcher` cuts that text at the first stop string, and :class:`SampleText` chains
the two for one sample.

The detokenizer decodes a bounded window of the latest tokens, never the whole output (the
prefix-offset technique of incremental detokenizers, e.g. vLLM's and TGI's). Its model of a
decode: the text of tokens is the lossy UTF-8 decoding of their concatenated bytes (special tokens
have none), an incomplete sequence at the end rendered as U+FFFD (one, as byte-level BPE and
:class:`~pagedkv.text.tokenizer.ByteTokenizer` do, or one per byte, as a byte-fallback decoder
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
become one), so no stop string can begin in the delivered text; the stop string that completes
first (of those completing at the same character, the longest) ends the text before it — a
function of the text alone, however it was chunked. It scans each pushed character once through
an Aho-Corasick automaton of the stop strings (:class:`StopStrings`), carrying its state between
pushes, so a character costs amortized O(1) whatever the number of stop strings (before, each
push searched every stop string: 100k of them cost ~14 ms per token, issue 23).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedkv.text.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "SampleText", "StopStringMatcher", "StopStrings"]

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


class StopStrings:
    """The Aho-Corasick automaton of a set of stop strings (non-empty), immutable: a trie of the
    strings whose every state also links to the state of its longest proper suffix that is in the
    trie. State ``q`` stands for the text's longest suffix that is a prefix of a stop string, of
    ``depth[q]`` chars; ``ends[q]`` is the length of the longest stop string that is a suffix of
    it (0: none)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.ends = [0]
        for stop in stops:
            state = 0
            for char in stop:
                if (next_state := self.goto[state].get(char)) is None:
                    next_state = len(self.goto)
                    self.goto[state][char] = next_state
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.ends.append(0)
                state = next_state
            self.ends[state] = len(stop)
        self.suffix = [0] * len(self.goto)
        queue = deque(self.goto[0].values())  # breadth first: a state's suffix link is shallower
        while queue:
            state = queue.popleft()
            for char, child in self.goto[state].items():
                link = self.step(self.suffix[state], char) if state else 0
                self.suffix[child] = link
                self.ends[child] = self.ends[child] or self.ends[link]  # its own is the longest
                queue.append(child)

    def step(self, state: int, char: str) -> int:
        """The state after ``char`` (amortized O(1) over a text: each suffix link taken is
        shallower, and each char deepens by at most one)."""
        while state and char not in self.goto[state]:
            state = self.suffix[state]
        return self.goto[state].get(char, 0)


@functools.lru_cache(maxsize=16)
def _automaton(stops: tuple[str, ...]) -> StopStrings:
    """Shared by a request's samples and by requests with the same stops (at most 16 kept: with
    :data:`~pagedkv.sampling.MAX_STOP_STRINGS` strings of at most
    :data:`~pagedkv.sampling.MAX_STOP_STRING_CHARS` chars, 4,096 states each)."""
    return StopStrings(stops)


class StopStringMatcher:
    """Cuts a text stream at the first stop string of ``stops`` (non-empty strings) to complete."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._automaton = _automaton(tuple(stops))
        self._state = 0
        self._held = ""  # delivered to no one yet: the automaton state's depth of chars
        self.stopped = False

    def push(self, delta: str) -> str:
        """The text of ``delta`` that can be delivered now; sets :attr:`stopped` when a stop string
        completes (what follows it is dropped, and so is every later push)."""
        if self.stopped:
            return ""
        automaton, state = self._automaton, self._state
        for i, char in enumerate(delta):
            state = automaton.step(state, char)
            if automaton.ends[state]:
                text, self._held, self.stopped = self._held + delta[: i + 1], "", True
                return text[: len(text) - automaton.ends[state]]
        self._state = state
        text = self._held + delta
        keep = automaton.depth[state]
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def finish(self) -> str:
        """The held suffix (the stream ended without completing a stop string)."""
        held, self._held, self._state = self._held, "", 0
        return held


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
