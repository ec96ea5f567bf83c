"""A request's prompts turned into token ids off the event loop: :class:`PromptEncoder`.

Tokenizing a long prompt or rendering a chat template is CPU work proportional to what the client
sent: done in the event loop's thread it stalled every other client (a 20 MB prompt: ~5 s; a
template looping without end: for good, SIGTERM included; issue 23). Here it runs in a few
threads of its own, while the loop goes on answering.

Invariants:

- A text longer than ``max_model_len * tokenizer.max_token_chars`` characters is refused (400)
  before it is tokenized: it cannot fit the model's length, whatever its tokens.
- Rendering and tokenizing run in at most :data:`ENCODER_THREADS` threads; tokenizing releases
  the GIL (:meth:`~pagedkv.text.tokenizer.HFTokenizer.encode`) and rendering is bounded in time
  and size (:mod:`pagedkv.text.chat`), so a thread is never held long.
- A conversation's tool calls, tool results and offered functions are rendered as
  :func:`pagedkv.server.tools.prepare_conversation` says: by the template where it reads
  ``tools``, else in the tool-call format of :mod:`pagedkv.server.tools`.
- Errors are those of :mod:`pagedkv.text.prompt`: :class:`~pagedkv.errors.InvalidArgumentError`
  or :class:`~pagedkv.errors.NoChatTemplateError`, raised to the request's handler.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagedkv.errors import InvalidArgumentError
from pagedkv.server.tools import Function, prepare_conversation
from pagedkv.text.chat import template_reads
from pagedkv.text.prompt import encode_chat, encode_text
from pagedkv.text.tokenizer import Tokenizer

__all__ = ["ENCODER_THREADS", "Prompt", "PromptEncoder"]

# Threads encoding prompts at once: more than the 2 cores the engine shares, so one long prompt
# never queues the short ones behind it.
ENCODER_THREADS = 4

# A text prompt, token ids, or a conversation.
Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]


class PromptEncoder:
    """Prompts of one tokenizer as token ids, encoded in a thread pool (see the module doc)."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self._tokenizer = tokenizer
        self._max_chars = max_model_len * tokenizer.max_token_chars
        self._pool = ThreadPoolExecutor(ENCODER_THREADS, thread_name_prefix="pagedkv-prompts")

    async def encode(self, prompt: Prompt, chat: bool, *, add_special_tokens: bool = True,
                     add_generation_prompt: bool = True, functions: Sequence[Function] | None = None) -> Sequence[int]:
        """The token ids of ``prompt``: a conversation (``chat``) rendered with the tokenizer's
        chat template, offering ``functions``, then tokenized; a text tokenized; token ids as
        they are."""
        loop = asyncio.get_running_loop()
        if chat:
            render = functools.partial(_encode_conversation, self._tokenizer, prompt, functions,  # type: ignore[arg-type]
                                       add_generation_prompt)
            text, token_ids = await loop.run_in_executor(self._pool, render)
            self._check_length(text)  # rendered within its bounds; refused here if it cannot fit
            return token_ids
        if isinstance(prompt, str):
            self._check_length(prompt)
            return await loop.run_in_executor(self._pool, encode_text, self._tokenizer, prompt, add_special_tokens)
        return prompt  # type: ignore[return-value]

    async def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (each below the vocabulary's size, else
        :class:`InvalidArgumentError`), decoded in the pool."""
        vocab = self._tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise InvalidArgumentError(f"token ids must lie in [0, {vocab})")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._tokenizer.decode, token_ids)

    def _check_length(self, text: str) -> None:
        if len(text) > self._max_chars:
            raise InvalidArgumentError(
                f"the prompt of {len(text)} characters cannot fit max_model_len: it holds more than "
                f"{self._max_chars // self._tokenizer.max_token_chars} tokens"
            )


def _encode_conversation(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], functions: Sequence[Function] | None,
                         add_generation_prompt: bool) -> tuple[str, list[int]]:
    template = getattr(tokenizer, "chat_template", None)  # None: encode_chat raises NoChatTemplateError
    reads_tools = template is not None and template_reads(template, "tools")
    conversation, tools = prepare_conversation(messages, functions, reads_tools)
    return encode_chat(tokenizer, conversation, add_generation_prompt, tools=tools)
