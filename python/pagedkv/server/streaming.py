"""Server-sent events: a generation streamed as ``data: {chunk}\\n\\n`` lines ending with
``data: [DONE]\\n\\n``.

Invariants:

- Every stream ends with ``[DONE]``, after either each choice's finish (a chunk with its
  ``finish_reason``) or one error event ``data: {"error": {...}}`` (the OpenAI client raises it):
  the engine failed the request, or shut down past its drain timeout. No stream just stops.
- Leaving the generator early (the client disconnected: Starlette cancels or closes it) aborts the
  generation: its blocks return to the pool at the engine's next step.
- With ``include_usage``, the last chunk before ``[DONE]`` has no choices and the usage. With
  ``continuous_usage``, every chunk carrying a token also carries the usage so far (each prompt
  once, the tokens streamed so far; vLLM's ``continuous_usage_stats``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from pagedkv.errors import PagedKVError
from pagedkv.server.errors import classify, error_body
from pagedkv.server.formats import Format, StreamState
from pagedkv.server.generation import Generation, usage

__all__ = ["DONE", "running_usage", "sse", "stream"]

DONE = "data: [DONE]\n\n"


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def stream(generation: Generation, fmt: Format, include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[str]:
    logprobs = generation.params.logprobs
    offsets: dict[int, int] = {}  # characters streamed per choice (completions' text_offset)
    state: StreamState = {}
    prompt_tokens = sum(len(h.prompt_token_ids) for h in generation.handles)
    produced = 0  # tokens of every choice so far
    try:
        openings = [fmt.opening(i) for i in range(len(generation.handles) * generation.n)]
        if any(o is not None for o in openings):
            yield sse(fmt.chunk(generation, [o for o in openings if o is not None]))
        async for index, event in generation.events():
            produced += 1
            if not (event.text or event.finish_reason is not None or logprobs):
                continue  # text held back (an incomplete character or stop string)
            offset = offsets.get(index, 0)
            offsets[index] = offset + len(event.text)
            so_far = running_usage(prompt_tokens, produced) if continuous_usage else None
            for choice in fmt.chunk_choices(generation, state, index, event, offset):
                yield sse(fmt.chunk(generation, [choice], so_far))
        outputs = await generation.outputs()
        generation.check_ended(outputs)
        if include_usage:
            yield sse(fmt.chunk(generation, [], usage(outputs)))
    except PagedKVError as error:
        status, kind = classify(error)
        yield sse(error_body(str(error), kind, status))
    finally:
        generation.abort()  # a no-op once every submission has ended
    yield DONE
