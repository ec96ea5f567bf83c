"""The replica-feed protocol, sans I/O: what a front end knows of each replica — whether the router
has it, which incarnation of it, its KV event feed and its load — and what a request carried to
another replica asks there. The Ray front end (:mod:`pagedkv.cluster.frontend`) and the simulated
cluster (``lab/serving/cluster.py``) both drive it: they move the messages (Ray calls, simulated
deliveries) and keep the time; this module decides what each message does. No I/O, no threads, no
clock of its own: every time is passed in.

Invariants:

- A :class:`ReplicaFeed` is a member of its :class:`~pagedkv.cluster.Router` from :meth:`join` to
  :meth:`lose`, under one incarnation; each join is a new ``epoch``. Batches, resyncs and load
  reports are a member's only (the router knows no other replica); the caller drops a message
  from another incarnation (:meth:`ReplicaFeed.current`) or epoch before it reaches the feed.
- The router's index of a member is fed by its event batches in sequence order, and by nothing
  else but snapshots. Whatever arrives, the feed checks the router reached the sequence the message
  says it brings (``last_seq``): short of it (a batch lost on the way, or refused after a gap), it
  asks for a resync from the router's sequence — once: no second request while one is
  outstanding (:meth:`ReplicaFeed.resynced` answers it, :meth:`ReplicaFeed.lose` forgets it).
- A request routed to a replica is counted there until :meth:`ReplicaFeed.finished` with the epoch
  it was routed in; a request of an earlier epoch (or a replica no longer a member) counts nowhere
  any more (removing the replica dropped its count), so it is not finished twice.
- A replica answers a receiver holding batches up to ``after_seq`` with the batches after it
  while its publisher's replay buffer (and the caller's bound) still holds them, else — and when
  the receiver knows nothing (None) — with a snapshot (:func:`replica_answer`). Its load
  (:func:`replica_load`) is its waiting and running sequences and the fraction of its KV blocks in
  use now (cached blocks that may be evicted count as free).
- A request moved to another replica continues from what its client has seen
  (:func:`continuation`): its prompt plus the tokens already streamed, one sample, asking only for
  the rest. A greedy continuation equals the uninterrupted run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

from pagedkv.cluster.router import ReplicaLoad, Router
from pagedkv.kv_events import KvEventBatch, KvEventPublisher, KvSnapshot
from pagedkv.sampling import SamplingParams

if TYPE_CHECKING:
    from pagedkv.engine import EngineCore

__all__ = ["ReplicaFeed", "continuation", "replica_answer", "replica_load"]


class ReplicaFeed:
    """One replica's membership in a :class:`Router` and its KV event and load feed (module doc).

    ``incarnation`` identifies what answers (a process's id, drawn anew at each restart; None
    when the caller tells incarnations apart by ``epoch``): the member's, or the last one's. Counters and times are for reports:
    ``deaths`` (losses while a member), ``snapshots`` and ``replays`` (resyncs applied while a
    member, by kind), ``down_since`` (the time of the latest loss until the next join) and
    ``recoveries`` (each loss to its next join, in the caller's time unit).
    """

    def __init__(self, router: Router, replica_id: str) -> None:
        self.router = router
        self.replica_id = replica_id
        self.member = False
        self.incarnation: Hashable = None
        self.epoch = 0  # joins so far
        self.resyncing = False  # a resync was asked for and not answered yet
        self.load: ReplicaLoad | None = None  # the last report applied
        self.deaths = 0
        self.snapshots = 0
        self.replays = 0
        self.down_since: float | None = None
        self.recoveries: list[float] = []

    @property
    def applied_seq(self) -> int | None:
        """The batch the router's index of it is at (None: not a member): ask from here."""
        return self.router.applied_seq(self.replica_id) if self.member else None

    def current(self, incarnation: Hashable) -> bool:
        """Whether a message from ``incarnation`` concerns the member the router has."""
        return self.member and incarnation == self.incarnation

    def join(self, now: float, snapshot: KvSnapshot | None = None, incarnation: Hashable = None) -> None:
        """The replica answers as ``incarnation``: it joins the router, its index ``snapshot`` (None:
        an empty cache, before its first batch). A member rejoins only after :meth:`lose`."""
        assert not self.member, f"replica {self.replica_id!r} joined twice"
        self.router.add_replica(self.replica_id)
        if snapshot is not None:
            self.router.resync(self.replica_id, snapshot)
        self.member, self.incarnation, self.resyncing = True, incarnation, False
        self.epoch += 1
        if self.down_since is not None:
            self.recoveries.append(now - self.down_since)
            self.down_since = None

    def lose(self, now: float) -> bool:
        """The replica is found dead (or restarted, or silent past its deadline): it leaves the
        router, and what was routed there counts nowhere. False if it was not a member."""
        if not self.member:
            return False
        self.member, self.resyncing = False, False  # its incarnation stays: the last one seen
        self.deaths += 1
        self.down_since = now
        self.router.remove_replica(self.replica_id)
        return True

    def batches(self, batches: Sequence[KvEventBatch], last_seq: int) -> int | None:
        """Applies a member's ``batches`` (in order, stopping at the first refused) that bring it to
        ``last_seq``. Returns None when the index got there, else the seq to ask a resync from
        (None too while one is outstanding)."""
        for batch in batches:
            if not self.router.apply(self.replica_id, batch):
                break
        seq = self.router.applied_seq(self.replica_id)
        if seq >= last_seq or self.resyncing:
            return None
        self.resyncing = True
        return seq

    def resynced(self, reply: Sequence[KvEventBatch] | KvSnapshot) -> None:
        """A member's answer to a resync, or a snapshot it sent unasked: its replay (the batches
        after the seq asked) or its snapshot."""
        self.resyncing = False
        if isinstance(reply, KvSnapshot):
            self.snapshots += 1
            self.router.resync(self.replica_id, reply)
        else:
            self.replays += 1
            for batch in reply:
                self.router.apply(self.replica_id, batch)

    def report(self, load: ReplicaLoad) -> None:
        """A member's load report."""
        self.load = load
        self.router.update_load(self.replica_id, load)

    def finished(self, epoch: int) -> None:
        """A request routed to the replica in ``epoch`` has ended (or left it)."""
        if self.member and epoch == self.epoch:
            self.router.finished(self.replica_id)


def continuation(prompt: Sequence[int], params: SamplingParams, streamed: Sequence[int]) -> tuple[list[int], SamplingParams]:
    """The request that carries on one sample on another replica after ``streamed`` of its tokens
    reached the client: ``prompt`` plus those tokens, one sample, ``max_tokens`` less their number,
    and a constraint (``structured_outputs``) that continues past them rather than starting over."""
    structured = params.structured_outputs
    if structured is not None:
        structured = dataclasses.replace(structured, continued_from=tuple(streamed))
    carried = dataclasses.replace(params, n=1, max_tokens=params.max_tokens - len(streamed), structured_outputs=structured)
    return [*prompt, *streamed], carried


def replica_answer(
    publisher: KvEventPublisher, after_seq: int | None, snapshot: Callable[[], KvSnapshot], replay: int | None = None
) -> list[KvEventBatch] | KvSnapshot:
    """A replica's answer to a receiver holding its batches up to ``after_seq`` (None: nothing):
    the batches after it while ``publisher`` still holds them and there are at most ``replay``
    (None: no bound but the publisher's buffer), else ``snapshot()``."""
    if after_seq is not None and (replay is None or publisher.last_seq - after_seq <= replay):
        batches = publisher.since(after_seq)
        if batches is not None:
            return batches
    return snapshot()


def replica_load(core: EngineCore) -> ReplicaLoad:
    """What the router balances by: ``core``'s waiting and running sequences and the fraction of
    its KV blocks in use, now."""
    scheduler = core.scheduler
    return ReplicaLoad(scheduler.num_waiting, scheduler.num_running, 1 - scheduler.num_free_blocks / core.config.num_blocks)
