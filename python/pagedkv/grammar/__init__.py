"""Constrained decoding: what an output must match (:class:`StructuredOutputs`, a field of
:class:`~pagedkv.sampling.SamplingParams`) and its compilation for a model's vocabulary
(:class:`GrammarCompiler`). The masks themselves are computed and applied in the Rust core
(``src/grammar/``, ``src/compute/sampling.rs``)."""

from __future__ import annotations

from pagedkv.grammar.compiler import DEFAULT_GRAMMAR_CACHE, GrammarCompiler
from pagedkv.grammar.spec import MAX_CHOICES, MAX_GRAMMAR_CHARS, StructuredOutputs

__all__ = ["DEFAULT_GRAMMAR_CACHE", "MAX_CHOICES", "MAX_GRAMMAR_CHARS", "GrammarCompiler", "StructuredOutputs"]
