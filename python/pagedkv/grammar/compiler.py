"""Compiling :class:`~pagedkv.grammar.spec.StructuredOutputs` for one model:
:class:`GrammarCompiler`, with a bounded cache of compiled grammars.

Invariants:

- The vocabulary (the tokenizer's bytes per token id, :class:`pagedkv._core.Vocabulary`) is built
  once, on the first constraint, and covers exactly the model's ``vocab_size`` ids: ids past the
  tokenizer's are special tokens of no text (never allowed inside an output); tokenizer ids past
  the model's are dropped (the model cannot produce them).
- A distinct constraint (:attr:`StructuredOutputs.key`) is compiled once while it stays among the
  ``capacity`` most recently used; two threads asking for the same uncached one at once may both
  compile it (the work is the same; the cache keeps one). Compiling releases the GIL.
- A constraint that does not compile is :class:`~pagedkv.errors.InvalidArgumentError` naming the
  problem, counted in ``grammar_rejected``; nothing is cached for it.
- :meth:`stats` counts compiles, their seconds, cache hits and rejections since the compiler was
  made (what the server's metrics export).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from pagedkv._core import Grammar, Vocabulary
from pagedkv.errors import InvalidArgumentError
from pagedkv.grammar.spec import StructuredOutputs
from pagedkv.text.tokenizer import Tokenizer

__all__ = ["DEFAULT_GRAMMAR_CACHE", "GrammarCompiler"]

# Compiled grammars kept. A compiled JSON schema holds a few hundred kB at most (the lexer's
# states are built lazily, as outputs need them).
DEFAULT_GRAMMAR_CACHE = 64

_COUNTS = ("grammar_compiles", "grammar_compile_seconds", "grammar_cache_hits", "grammar_rejected")


class GrammarCompiler:
    """Compiles constraints against one tokenizer's vocabulary of ``vocab_size`` ids, ended by
    ``eos_token_ids[0]``."""

    def __init__(
        self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Sequence[int], capacity: int = DEFAULT_GRAMMAR_CACHE
    ) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise InvalidArgumentError(f"the grammar cache needs a capacity ≥ 1, got {capacity!r}")
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._capacity = capacity
        self._vocabulary: Vocabulary | None = None
        self._cache: OrderedDict[tuple, Grammar] = OrderedDict()
        self._lock = threading.Lock()  # the cache, the vocabulary and the counts
        self._vocabulary_lock = threading.Lock()  # built once, outside the cache's lock
        self._counts = dict.fromkeys(_COUNTS, 0.0)

    def compile(self, spec: StructuredOutputs) -> Grammar:
        """The compiled grammar of ``spec`` (from the cache, or compiled now). Raises
        :class:`InvalidArgumentError` for one that does not compile or matches nothing, or when
        this model has no tokenizer or end-of-sequence token to constrain outputs with."""
        if not isinstance(spec, StructuredOutputs):
            raise InvalidArgumentError(f"structured_outputs must be StructuredOutputs, got {type(spec).__name__}")
        key = spec.key
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                self._counts["grammar_cache_hits"] += 1
                return grammar
        vocabulary = self.vocabulary()
        started = time.perf_counter()
        try:
            grammar = Grammar(vocabulary, **spec.compile_arguments())
        except InvalidArgumentError:
            with self._lock:
                self._counts["grammar_rejected"] += 1
            raise
        seconds = time.perf_counter() - started
        with self._lock:
            self._counts["grammar_compiles"] += 1
            self._counts["grammar_compile_seconds"] += seconds
            self._cache[key] = grammar
            self._cache.move_to_end(key)
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        return grammar

    def vocabulary(self) -> Vocabulary:
        """The model's vocabulary as grammars see it (built on first use)."""
        with self._vocabulary_lock:
            if self._vocabulary is None:
                self._vocabulary = self._build_vocabulary()
            return self._vocabulary

    def prepare_in_background(self) -> threading.Thread:
        """Starts building the vocabulary in a daemon thread, so that the first constraint does
        not wait for it (Gemma 3's 262,144 tokens take ~2 s: 1.0 s spelling them, 0.8 s in
        llguidance's token trie). A server calls it at start-up; a constraint arriving meanwhile
        waits for the one build. A model that cannot constrain (no tokenizer or end of sequence)
        builds nothing: its first constraint gets the error."""

        def build() -> None:
            try:
                self.vocabulary()
            except InvalidArgumentError:
                pass  # said again, to the request, by compile()

        thread = threading.Thread(target=build, name="pagedkv-grammar-vocabulary", daemon=True)
        thread.start()
        return thread

    def _build_vocabulary(self) -> Vocabulary:
        if self._tokenizer is None:
            raise InvalidArgumentError("structured outputs need text: this engine has no tokenizer")
        if not self._eos:
            raise InvalidArgumentError("structured outputs need an end-of-sequence token: this model has none")
        tokens, special = self._tokenizer.token_bytes()
        size = self._vocab_size
        tokens, special = list(tokens[:size]), list(special[:size])
        missing = size - len(tokens)
        tokens += [b""] * missing  # ids the model has and the tokenizer does not: no text
        special += [True] * missing
        return Vocabulary(tokens, special, self._eos[0])

    def __len__(self) -> int:
        """Grammars cached now."""
        with self._lock:
            return len(self._cache)

    def stats(self) -> dict[str, float]:
        """Compiles, their total seconds, cache hits and rejected constraints, since made."""
        with self._lock:
            return dict(self._counts)
