"""KV cache events in Python: what an engine tells a router about the blocks it holds, and the
publisher that numbers them, keeps a replay buffer, and serves snapshots.

The event kinds are the core's (``src/memory/events.rs``, vLLM's names), one frozen class each made
in Rust straight from the block manager's event (``src/python/events.rs``): :class:`BlockStored`
when a full block becomes findable by prefix lookup in a medium (``"ram"`` or ``"disk"``),
:class:`BlockRemoved` when it stops being findable there, :class:`AllBlocksCleared` when a whole
medium is emptied.

Invariants of a :class:`KvEventPublisher`:

- Batches are numbered 1, 2, 3, ... with no gap: ``publish`` of a non-empty list makes batch
  ``last_seq + 1``; an empty list makes no batch and consumes no number.
- ``snapshot()`` is the fold of every batch published so far over the empty set of
  ``(block_hash, medium)`` pairs, tagged with ``last_seq``: a subscriber that applied batches
  ``1..s`` in order holds exactly ``snapshot().blocks`` of a snapshot taken at ``seq == s``. The
  Rust invariant (replaying a manager's events gives the blocks it holds findable) makes this the
  engine's truth.
- ``since(s)`` returns batches ``s+1 .. last_seq`` in order while the replay buffer (the last
  ``replay`` batches) still holds ``s+1``, else None: the caller must then take a snapshot.
- Publishing is two halves: ``record`` numbers a batch, folds it and queues it for delivery (an
  engine calls it under its own lock, so its snapshots agree with the numbering); ``deliver``
  hands the queued batches to the subscribers, and must be called holding no lock of the
  caller's (an engine calls it after releasing its lock, so a callback may call back into the
  engine: ``kv_snapshot``, ``submit``). ``publish`` is both.
- Subscribers get every batch recorded while they are subscribed, once, in numbering order, from
  one thread at a time: a ``deliver`` called while another runs (in another thread, or from a
  callback) returns at once, and the running one delivers what was queued meanwhile.
- A callback that raises is logged and skipped for that batch; it stops neither the publisher nor
  the thread delivering (an engine's worker), whatever it raises, ``SystemExit`` and
  ``KeyboardInterrupt`` included (:mod:`pagedkv.callbacks`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedkv._core import AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv.callbacks import call_guarded
from pagedkv.errors import InvalidArgumentError

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KvEvent",
    "KvEventBatch",
    "KvEventPublisher",
    "KvSnapshot",
]

KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
_EVENT_TYPES = (BlockStored, BlockRemoved, AllBlocksCleared)


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """Events published together, in order; ``seq`` counts batches of one publisher from 1;
    ``timestamp`` is the publisher's clock when it was published."""

    seq: int
    timestamp: float
    events: tuple[KvEvent, ...]

    def __post_init__(self) -> None:
        bad = [e for e in self.events if type(e) not in _EVENT_TYPES]
        if bad:
            raise InvalidArgumentError(f"not KV events: {bad[:3]!r}")


@dataclass(frozen=True, slots=True)
class KvSnapshot:
    """The ``(block_hash, medium)`` pairs findable after batch ``seq`` (0: before any batch)."""

    seq: int
    blocks: frozenset[tuple[int, str]]


def _apply_events(blocks: set[tuple[int, str]], events: Sequence[KvEvent]) -> None:
    """Folds ``events`` into ``blocks`` in order (the router's inverted index gives them the same meaning)."""
    for event in events:
        if type(event) is BlockStored:
            blocks.add((event.block_hash, event.medium))
        elif type(event) is BlockRemoved:
            blocks.discard((event.block_hash, event.medium))
        else:  # AllBlocksCleared: a batch holds nothing else
            medium = event.medium
            blocks.difference_update([b for b in blocks if b[1] == medium])


class KvEventPublisher:
    """Numbers an engine's KV events into batches, keeps the last ``replay`` of them for
    :meth:`since`, folds them into the state :meth:`snapshot` reports, and calls subscribers.

    ``record`` is meant for one thread at a time (the engine's calls hold its lock); every other
    method may be called from any thread. ``clock`` stamps batches (wall time by default; a
    simulation passes its virtual clock).
    """

    def __init__(self, replay: int = 1024, clock: Callable[[], float] = time.time) -> None:
        if isinstance(replay, bool) or not isinstance(replay, int) or replay < 0:
            raise InvalidArgumentError(f"replay must be an int ≥ 0 (batches kept), got {replay!r}")
        self._clock = clock
        self._lock = threading.Lock()  # guards every field below
        self._seq = 0
        self._buffer: deque[KvEventBatch] = deque(maxlen=replay)
        self._blocks: set[tuple[int, str]] = set()
        self._subscribers: dict[int, Callable[[KvEventBatch], None]] = {}
        self._ids = itertools.count()
        self._undelivered: deque[KvEventBatch] = deque()  # recorded, not yet handed to subscribers
        self._delivering = False  # a deliver() is running (in some thread)

    @property
    def last_seq(self) -> int:
        """The number of the latest batch (0 before the first)."""
        return self._seq

    def publish(self, events: Sequence[KvEvent]) -> KvEventBatch | None:
        """Records ``events`` (:meth:`record`) and delivers them (:meth:`deliver`): for a caller
        holding no lock a subscriber might need."""
        batch = self.record(events)
        self.deliver()
        return batch

    def record(self, events: Sequence[KvEvent]) -> KvEventBatch | None:
        """Makes ``events`` batch ``last_seq + 1`` (in :meth:`since` and :meth:`snapshot` at
        once) and queues it for the subscribers; None (and no number used) for no events. Calls
        no subscriber: :meth:`deliver` does. Raises :class:`InvalidArgumentError`, recording
        nothing, if an item is not a KV event."""
        if not events:
            return None
        with self._lock:
            batch = KvEventBatch(self._seq + 1, self._clock(), tuple(events))  # checks the events
            _apply_events(self._blocks, batch.events)
            self._seq = batch.seq
            self._buffer.append(batch)
            if self._subscribers:
                self._undelivered.append(batch)
        return batch

    def deliver(self) -> None:
        """Hands every recorded batch not yet delivered to the subscribers, in order, unless a
        delivery is already running (in another thread, or this call comes from a callback):
        that one then delivers them. Call it holding no lock a callback may need."""
        with self._lock:
            if self._delivering:
                return
            self._delivering = True
        try:
            while True:
                with self._lock:
                    if not self._undelivered:
                        self._delivering = False
                        return
                    batch = self._undelivered.popleft()
                    subscribers = list(self._subscribers.values())
                for callback in subscribers:
                    call_guarded(callback, batch, what=f"KV event subscriber (batch {batch.seq})")
        except BaseException:
            with self._lock:  # only call_guarded's own failure gets here: leave a deliverable state
                self._delivering = False
            raise

    def subscribe(self, callback: Callable[[KvEventBatch], None]) -> Callable[[], None]:
        """Calls ``callback(batch)`` for every batch published from now on; returns a function
        that unsubscribes it (calling it again does nothing)."""
        if not callable(callback):
            raise InvalidArgumentError(f"callback must be callable, got {callback!r}")
        with self._lock:
            key = next(self._ids)
            self._subscribers[key] = callback

        def unsubscribe() -> None:
            with self._lock:
                self._subscribers.pop(key, None)

        return unsubscribe

    def since(self, seq: int) -> list[KvEventBatch] | None:
        """Batches ``seq + 1 .. last_seq`` in order (empty when ``seq >= last_seq``), or None when
        the replay buffer no longer holds batch ``seq + 1``."""
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise InvalidArgumentError(f"seq must be an int ≥ 0, got {seq!r}")
        with self._lock:
            if seq >= self._seq:
                return []
            oldest = self._buffer[0].seq if self._buffer else self._seq + 1
            if seq + 1 < oldest:
                return None
            return list(itertools.islice(self._buffer, seq + 1 - oldest, None))

    def snapshot(self) -> KvSnapshot:
        """Every block findable now, as of batch ``last_seq``."""
        with self._lock:
            return KvSnapshot(self._seq, frozenset(self._blocks))

