"""Text: tokenizers, incremental detokenizing with stop strings, chat templates, and prompts
turned into token ids. Nothing here reads files (:mod:`pagedkv.loaders.tokenizers` does).
"""

from __future__ import annotations

from pagedkv.text.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer"]
