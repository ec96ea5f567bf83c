"""Calling user code from the engine: KV-event subscribers, a tracer (and its span exporters),
a tokenizer. What that code raises is its own fault, never the engine's.

Invariants:

- A callback's exception never escapes into the engine: whatever it raises is logged with its
  traceback and the callback is skipped (:func:`call_guarded`); a tokenizer's fails the request
  it was decoding, alone.
- That includes ``SystemExit`` and ``KeyboardInterrupt``. Raised by a callback in the engine's
  worker they can only be the callback's own doing (signals reach the main thread alone), and
  letting them through would end the worker and close the engine for every request. In the main
  thread (a ``kv_snapshot``, ``submit`` or ``shutdown`` there runs callbacks too) they are
  logged rather than raised as well, as one rule: raised there they would leave a request
  half-added or a batch half-delivered. (A Ctrl-C landing while the main thread runs a callback
  is thus logged; the main thread spends its time waiting on handles, where it is raised.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["call_guarded"]

_log = logging.getLogger(__name__)


def call_guarded(callback: Callable[..., Any], *args: Any, what: str) -> None:
    """Calls ``callback(*args)``; logs what it raises, naming it ``what``, and returns."""
    try:
        callback(*args)
    except BaseException as error:  # noqa: BLE001 - see the module doc: nothing a callback raises stops the engine
        _log.error("%s %r raised %r; skipped", what, callback, error, exc_info=error)
