"""Prompts as token ids: a text (:func:`encode_text`) or a conversation rendered with the
tokenizer's chat template (:func:`encode_chat`). The one place both are turned into tokens, for
an :class:`~pagedkv.Engine` and for a cluster's front end (which routes on the tokens before any
replica sees them).

Invariant: a prompt that cannot be encoded raises :class:`InvalidArgumentError` (or
:class:`NoChatTemplateError`), in the caller, before anything is queued.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagedkv.errors import InvalidArgumentError, NoChatTemplateError
from pagedkv.text.chat import render_chat
from pagedkv.text.tokenizer import Tokenizer

__all__ = ["encode_chat", "encode_text"]


def encode_text(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """The token ids of ``text``."""
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except UnicodeError as error:
        raise InvalidArgumentError(f"the prompt cannot be tokenized: {error}") from None


def encode_chat(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]],
                add_generation_prompt: bool = True, tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[str, list[int]]:
    """The rendered text of a conversation and its token ids (without special tokens added: the
    template writes them), as transformers' ``apply_chat_template`` renders it; ``tools``: the
    template's ``tools`` variable (OpenAI's tool definitions)."""
    template = getattr(tokenizer, "chat_template", None)  # a tokenizer of the protocol before chat
    if template is None:
        raise NoChatTemplateError(f"the model's tokenizer ({type(tokenizer).__name__}) has no chat template")
    text = render_chat(
        template,
        messages,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        bos_token=getattr(tokenizer, "bos_token", ""),
        eos_token=getattr(tokenizer, "eos_token", ""),
        source=getattr(tokenizer, "path", "the tokenizer's chat template"),
    )
    return text, encode_text(tokenizer, text, add_special_tokens=False)
