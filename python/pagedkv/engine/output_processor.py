"""Turning a sampled token into output: the one place a token joins its sample's
:class:`~pagedkv.engine.outputs.CompletionOutput` (ids, logprob, text delta, finish reason), its
request's metrics, and the :class:`~pagedkv.engine.outputs.TokenEvent` streamed to the caller.
The engine's core and the cluster's front end both build outputs through it.

Invariants:

- The text is decoded first (:class:`~pagedkv.text.detokenizer.SampleText`): if the tokenizer
  raises, nothing is appended and the exception propagates (the caller fails the request).
- A stop string completed by the token makes the finish reason ``"stop"``, whatever the
  scheduler said; the text stops before the stop string.
- ``len(completion.logprobs) == len(completion.token_ids)`` for a sample that asked for logprobs,
  as long as every token comes with its logprob.
"""

from __future__ import annotations

from pagedkv.engine.outputs import RequestOutput, TokenEvent, TokenLogprob
from pagedkv.text.detokenizer import SampleText

__all__ = ["append_token"]


def append_token(
    output: RequestOutput,
    text: SampleText | None,
    index: int,
    token: int,
    reason: str | None,
    logprob: TokenLogprob | None,
    now: float,
) -> TokenEvent:
    """Appends ``token`` (with ``logprob``, finishing with ``reason``, None while it runs) to sample
    ``index`` of ``output``, its text decoded by ``text`` (None: no tokenizer); counts it in the
    request's metrics at ``now``; returns the event to stream. Raises what the tokenizer raises,
    appending nothing."""
    completion = output.outputs[index]
    delta = ""
    if text is not None:
        delta = text.push(token, last=reason is not None)
        if text.stopped:
            reason = "stop"
    completion.token_ids.append(token)
    if completion.logprobs is not None and logprob is not None:
        completion.logprobs.append(logprob)
    completion.text += delta
    completion.finish_reason = reason
    metrics = output.metrics
    metrics.first_token_time = metrics.first_token_time or now
    metrics.num_output_tokens += 1
    return TokenEvent(output.request_id, index, token, reason, delta, logprob)
