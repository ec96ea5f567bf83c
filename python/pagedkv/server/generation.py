"""One HTTP request's generation: its engine submissions (one per prompt, ``n`` samples each), their
tokens merged into one stream of choices, and the OpenAI objects built from them.

Invariants:

- Choice ``i * n + j`` is sample ``j`` of prompt ``i`` (OpenAI's order for a list of prompts).
- :meth:`Generation.submit` (over an :class:`~pagedkv.server.client.EngineClient`) either
  returns a generation whose every submission is queued, or raises having queued nothing (the
  prompts queued before a refused one are aborted).
- :meth:`Generation.abort` ends every submission still running (a no-op for the ended ones): the
  server calls it whenever its client goes away, so no request outlives its connection.
- The text of a choice is its sample's :attr:`CompletionOutput.text`, which is the concatenation
  of its events' deltas: a stream and a whole response of the same seed say the same.
- ``finish_reason`` is OpenAI's: "stop" (EOS, a stop token, a stop string, or the end of what
  a constraint allows) or "length" (``max_tokens``, or the model's length), "tool_calls" for a
  sample that stopped after calling tools; a sample the engine aborted or failed has none, and
  :meth:`Generation.check_ended` raises for it.
- With :attr:`Generation.tools`, each choice's text is read by a fresh
  :class:`~pagedkv.server.tools.ToolCallParser`, streamed or whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

from pagedkv.engine import EngineClosedError, RequestHandle, RequestOutput, TokenEvent, TokenLogprob
from pagedkv.errors import PagedKVError
from pagedkv.sampling import SamplingParams
from pagedkv.server.client import EngineClient
from pagedkv.server.prompts import Prompt, PromptEncoder
from pagedkv.server.tools import Function, ToolUse
from pagedkv.text.tokenizer import Tokenizer

__all__ = ["Generation", "finish_reason", "usage"]

_FINISH = {"stop": "stop", "length": "length", "max_model_len": "length"}


def finish_reason(reason: str | None, called: bool = False) -> str | None:
    """OpenAI's name of an engine finish reason (None for one OpenAI has none for: abort,
    error); "tool_calls" for a stop after calls (``called``)."""
    if reason is None:
        return None
    named = _FINISH.get(reason)
    return "tool_calls" if called and named == "stop" else named


@dataclass
class Generation:
    """The submissions of one HTTP request."""

    id: str
    created: int
    handles: list[RequestHandle]
    n: int
    params: SamplingParams
    # Completions' echo: the prompt before each choice; score_only: and nothing generated after it.
    echo: bool = False
    score_only: bool = False
    # Chat with tools to call: how calls are read out of each choice's text.
    tools: ToolUse | None = None

    @classmethod
    async def submit(cls, client: EngineClient, encoder: PromptEncoder, prompts: Sequence[Prompt], params: SamplingParams,
                     *, chat: bool, cache_salt: str | None, trace_headers: Mapping[str, str] | None,
                     prefix: str, echo: bool = False, score_only: bool = False,
                     functions: Sequence[Function] | None = None, tools: ToolUse | None = None) -> Generation:
        """Encodes every prompt (off the event loop: a refused one raises before anything is
        queued; a conversation offers ``functions``), then queues each without waiting for room
        (a full queue raises ``EngineOverloadedError`` at once: the client is told to retry
        rather than held)."""
        token_ids = [await encoder.encode(prompt, chat, functions=functions) for prompt in prompts]
        handles: list[RequestHandle] = []
        try:
            for ids in token_ids:
                handles.append(await client.submit(ids, params, cache_salt=cache_salt, trace_headers=trace_headers))
        except BaseException:
            for handle in handles:
                handle.abort()
            raise
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), handles, params.n, params, echo, score_only, tools)

    def abort(self) -> None:
        for handle in self.handles:
            handle.abort()

    async def events(self) -> AsyncIterator[tuple[int, TokenEvent]]:
        """Every token of every submission as it is produced, with its choice index. Ends when
        every submission has ended (its error, if any, is for :meth:`outputs` to raise)."""
        queue: asyncio.Queue[tuple[int, TokenEvent | None]] = asyncio.Queue()

        async def pump(first_choice: int, handle: RequestHandle) -> None:
            try:
                with contextlib.suppress(PagedKVError):
                    async for event in handle:
                        queue.put_nowait((first_choice + event.index, event))
            finally:
                queue.put_nowait((first_choice, None))

        tasks = [asyncio.ensure_future(pump(i * self.n, h)) for i, h in enumerate(self.handles)]
        try:
            running = len(tasks)
            while running:
                choice, event = await queue.get()
                if event is None:
                    running -= 1
                else:
                    yield choice, event
        finally:
            for task in tasks:
                task.cancel()

    async def outputs(self) -> list[RequestOutput]:
        """The final outputs, in prompt order; raises a submission's error."""
        return [await handle for handle in self.handles]

    @staticmethod
    def check_ended(outputs: Sequence[RequestOutput]) -> None:
        """Raises :class:`EngineClosedError` if the engine aborted a sample (it does so only when
        shutting down past its drain timeout)."""
        if any(c.finish_reason == "abort" for o in outputs for c in o.outputs):
            raise EngineClosedError("the server shut down before the request finished")


def usage(outputs: Sequence[RequestOutput], generated: bool = True) -> dict:
    """OpenAI's ``usage``: each prompt counted once, every sample's tokens (none when not
    ``generated``: a prompt scored only), the prefix-cache hit."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs) if generated else 0
    cached = sum(o.num_cached_tokens for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class TokenText:
    """Token ids as the text of one token, for logprobs (``decode([id])``, cached)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._decode = tokenizer.decode
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._decode([token_id])
        return text

    def join(self, token_ids: Sequence[int]) -> str:
        """The text of several tokens decoded together (a token-id prompt echoed)."""
        return self._decode(list(token_ids))


def completion_logprobs(entries: Sequence[TokenLogprob], text: TokenText, offset: int = 0,
                        prompt: tuple[Sequence[int], Sequence[TokenLogprob | None]] | None = None) -> dict:
    """The legacy completions ``logprobs`` object of ``entries`` (``text_offset`` from ``offset``),
    after the ``prompt``'s (its token ids and their logprobs, None for the first) when echoed."""
    ids, scored = prompt if prompt is not None else ((), ())
    tokens = [text(t) for t in ids] + [text(e.token_id) for e in entries]
    offsets, position = [], offset
    for token in tokens:
        offsets.append(position)
        position += len(token)
    every = [*scored, *entries]
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e.logprob for e in every],
        "top_logprobs": [None if e is None else _by_text(e, text) for e in every],
        "text_offset": offsets,
    }


def _by_text(entry: TokenLogprob, text: TokenText) -> dict[str, float]:
    """The alternatives of ``entry`` keyed by their text, as the legacy format has them, with the
    chosen token among them (as OpenAI and vLLM list it, even for ``logprobs=0`` or when it is not
    among the top ones); of tokens with the same text (undecodable bytes all read U+FFFD) the most
    likely stays."""
    by_text: dict[str, float] = {}
    for token_id, logprob in entry.top:
        by_text.setdefault(text(token_id), logprob)
    by_text.setdefault(text(entry.token_id), entry.logprob)
    return by_text


def chat_logprobs(entries: Sequence[TokenLogprob], text: TokenText) -> dict:
    """The chat ``logprobs`` object of ``entries``."""

    def item(token_id: int, logprob: float) -> dict:
        token = text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}
