"""The replica feed, sans-IO: what a replica tells the router of its KV cache and load, and how
the router takes it in — one protocol, run by the Ray front end (:mod:`pagedkv.cluster.frontend`
with :mod:`pagedkv.cluster.replica`) and by the serving simulator (``lab/serving/cluster.py``),
each over its own transport and clock. Nothing here waits, sends or reads a clock.

Invariants:

- A replica answers a receiver that holds batches up to ``after_seq`` with the batches after it
  while its publisher's replay buffer (and the caller's ``replay`` bound) still holds them, else —
  and when ``after_seq`` is None, a receiver that knows nothing — with a snapshot
  (:func:`feed_since`). A :class:`Feed` carries one or the other, and the batch it brings the
  receiver to (``last_seq``).
- A receiver applies a feed's batches in order, stopping at the first the router refuses; it is
  in sync exactly when it then holds ``last_seq`` (:func:`apply_batches`); out of sync (a batch
  lost or refused: a gap), it asks for a snapshot, which replaces everything the router knew of
  the replica (``Router.resync``).
- A replica's load (:func:`replica_load`) is its waiting and running sequences and the fraction
  of its KV blocks in use (cached blocks that may be evicted count as free), read now.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.cluster.router import ReplicaLoad, Router
from pagedkv.kv_events import KvEventBatch, KvEventPublisher, KvSnapshot

if TYPE_CHECKING:
    from pagedkv.engine import EngineCore

__all__ = ["Feed", "apply_batches", "feed_since", "replica_load"]


@dataclass(frozen=True)
class Feed:
    """A replica's KV events since what the receiver holds (``batches``) or, when they are gone,
    a ``snapshot``; ``last_seq``: the batch the feed brings the receiver to."""

    batches: tuple[KvEventBatch, ...] | None
    snapshot: KvSnapshot | None
    last_seq: int


def feed_since(
    publisher: KvEventPublisher, after_seq: int | None, snapshot: Callable[[], KvSnapshot], replay: int | None = None
) -> Feed:
    """The feed for a receiver at ``after_seq`` (see the module invariants); ``snapshot`` takes the
    replica's snapshot when one is needed; ``replay`` (None: the publisher's buffer) bounds how
    many batches a replay may bring."""
    batches = None
    if after_seq is not None and (replay is None or publisher.last_seq - after_seq <= replay):
        batches = publisher.since(after_seq)
    if batches is None:
        taken = snapshot()
        return Feed(None, taken, taken.seq)
    return Feed(tuple(batches), None, batches[-1].seq if batches else after_seq)  # type: ignore[arg-type]


def apply_batches(router: Router, replica_id: str, feed: Feed) -> bool:
    """Applies ``feed``'s batches to ``replica_id`` in order, stopping at the first the router
    refuses; returns whether the router now holds the replica up to ``feed.last_seq`` (False: it
    needs a snapshot). A feed that brings a snapshot is the caller's to apply (``Router.resync``)."""
    for batch in feed.batches or ():
        if not router.apply(replica_id, batch):
            break
    return router.applied_seq(replica_id) >= feed.last_seq


def replica_load(core: EngineCore) -> ReplicaLoad:
    """What the router balances by: ``core``'s waiting and running sequences and the fraction of
    its KV blocks in use, now."""
    scheduler = core.scheduler
    return ReplicaLoad(scheduler.num_waiting, scheduler.num_running, 1 - scheduler.num_free_blocks / core.config.num_blocks)
