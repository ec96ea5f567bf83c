"""The request router of a cluster of engine replicas: which replica serves a prompt.

Policies (:data:`POLICIES`): ``round_robin`` (each live replica in turn), ``least_loaded`` (the
lowest load cost), ``prefix_aware`` (the default: the lowest load cost minus the prefix it would
not recompute there).

Invariants:

- The index (which replica holds which ``(block_hash, medium)``) is fed only by each replica's
  KV event batches (:meth:`Router.apply`) and snapshots (:meth:`Router.resync`). Batches of one
  replica apply in sequence order with no gap: :meth:`apply` of batch ``s`` applies it only if
  the replica's index is at ``s - 1``; an older batch is ignored, a newer one is refused (False)
  and the caller resyncs, from the publisher's replay (``since(applied_seq)``) or a snapshot. So
  after a resync and the batches that follow it, a replica's index equals its publisher's state.
- The index is the core's :class:`pagedkv.PrefixIndex` (``src/route/prefix_index.rs``), replicas
  numbered by their slot: hash → the slots holding it, per medium, beside each slot's own blocks
  (what :meth:`blocks_of` lists and what removal clears).
- Load per replica: ``queue_weight * waiting + kv_weight * kv_usage``, in units of one queued
  request. ``waiting`` estimates the replica's queue now: the requests routed there and not yet
  :meth:`finished`, less those its last load report showed running (so requests routed since the
  last report count as queued), or the reported ``num_waiting`` if larger; ``kv_usage`` is the
  last reported one. Running requests weigh only through the KV they hold: continuous batching
  takes a newcomer into the running batch while there is room.
- ``prefix_aware`` cost of a replica, in blocks of prefill work (as Dynamo's KV router counts
  cost in blocks): ``prompt_blocks - gain + load * mean_prompt_blocks``, where ``gain`` counts the
  prompt's leading blocks the replica holds — each held in RAM from the first block worth 1, the
  rest of the held run (after the first block not in RAM) worth ``disk_weight`` — and
  ``mean_prompt_blocks`` is a running mean over the prompts routed so far: a queued request costs
  about one typical prompt of work ahead of this one. A hit never covers the last prompt token
  (the model needs its logits), so only ``(len(prompt) - 1) // block_size`` blocks can count.
- ``route`` scores only the replicas holding the prompt's first reusable block plus the least
  loaded one (one ``numpy.argmin`` over the load array). The core hashes the prompt with the
  replicas' own hash chain and walks it once, giving each holder's run in RAM and then on disk
  (``PrefixIndex.longest_prefixes``): one call, no Python int per block. Measured at R = 256 with
  ~200-block prompts over a 504k-block index (loaded machine), the Python index (a Python int per
  hash, bisection, dicts) cost 55.9 µs a route; this one 27-47 µs (six runs, median 33 µs),
  most of it hashing and one cache miss per block walked.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from pagedkv._core import PrefixIndex  # hashes prompts with the replicas' own hash chain
from pagedkv.errors import InvalidArgumentError, PagedKVError
from pagedkv.kv_events import BlockRemoved, BlockStored, KvEventBatch, KvSnapshot

__all__ = ["POLICIES", "NoReplicaError", "ReplicaLoad", "Router", "UnknownReplicaError"]

POLICIES = ("round_robin", "least_loaded", "prefix_aware")

# Weight of the latest prompt in the running mean of prompt blocks: about the last 64 count.
_MEAN_ALPHA = 1.0 / 64


class NoReplicaError(PagedKVError, RuntimeError):
    """No live replica may take the request (none registered, or all excluded)."""


class UnknownReplicaError(PagedKVError, KeyError):
    """No replica has this id in the router."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """A replica's load as it reports it: requests waiting and running, and the fraction of its
    KV pool in use (0 to 1)."""

    num_waiting: int
    num_running: int
    kv_usage: float


class Router:
    """Picks a replica per request; see the module doc for the index and the cost.

    Not thread-safe: one thread (the front end's event loop, or a simulation) drives it.
    """

    def __init__(
        self,
        policy: str = "prefix_aware",
        block_size: int = 16,
        *,
        # A queued request weighs half a typical prompt. On the many-tenant trace (R = 16, 4
        # requests/s per replica offered, simulated) 1.0 gave a prefix hit rate of 0.345 and TTFT
        # p99 2.3 s; 0.5 gave 0.487 and 0.53 s at a load imbalance of 1.17 (1.10); 0.25 hit more
        # (0.524) but served less (imbalance 1.27).
        queue_weight: float = 0.5,
        kv_weight: float = 1.0,
        disk_weight: float = 0.5,
    ) -> None:
        """``queue_weight``: load of one queued request; ``kv_weight``: load of a full KV pool;
        ``disk_weight``: value of a cached block held only on disk, against 1 for RAM.
        Raises :class:`InvalidArgumentError` for an unknown policy or a bad number."""
        if policy not in POLICIES:
            raise InvalidArgumentError(f"unknown routing policy {policy!r}; expected one of {', '.join(POLICIES)}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise InvalidArgumentError(f"block_size must be an int ≥ 1, got {block_size!r}")
        for name, value in (("queue_weight", queue_weight), ("kv_weight", kv_weight)):
            if not 0 <= value < float("inf"):
                raise InvalidArgumentError(f"{name} must be finite and ≥ 0, got {value!r}")
        if not 0 <= disk_weight <= 1:
            raise InvalidArgumentError(f"disk_weight must be in [0, 1], got {disk_weight!r}")
        self.policy = policy
        self.block_size = block_size
        self.queue_weight = float(queue_weight)
        self.kv_weight = float(kv_weight)
        self.disk_weight = float(disk_weight)
        self._slot: dict[str, int] = {}  # replica id → slot
        self._ids: list[str | None] = []  # slot → replica id (None: free)
        self._live: list[int] = []  # slots in order of joining: round robin's cycle
        self._next = 0  # round robin: index into _live of the next turn
        self._index = PrefixIndex()  # replicas by slot
        self._seq: list[int] = []  # slot → seq of the last batch applied (or snapshot)
        self._outstanding: list[int] = []  # slot → routed, not finished
        self._waiting: list[int] = []  # slot → num_waiting of the last report
        self._running: list[int] = []  # slot → num_running of the last report
        self._kv_usage: list[float] = []
        self._load = np.empty(0)  # slot → load (inf for a free slot), what argmin reads
        self._mean_prompt_blocks = 0.0  # 0: no request routed yet

    # -- membership ---------------------------------------------------------------------------

    def add_replica(self, replica_id: str) -> None:
        """Registers a replica with an empty index, at batch 0 (its publisher's start). Raises
        :class:`InvalidArgumentError` for an id already registered."""
        if replica_id in self._slot:
            raise InvalidArgumentError(f"replica {replica_id!r} is already registered")
        if None in self._ids:
            slot = self._ids.index(None)
        else:
            slot = len(self._ids)
            self._ids.append(None)
            self._seq.append(0)
            self._outstanding.append(0)
            self._waiting.append(0)
            self._running.append(0)
            self._kv_usage.append(0.0)
            self._load = np.append(self._load, np.inf)
        self._ids[slot] = replica_id
        self._slot[replica_id] = slot
        self._live.append(slot)
        self._seq[slot] = self._outstanding[slot] = self._waiting[slot] = self._running[slot] = 0
        self._kv_usage[slot] = 0.0
        self._set_load(slot)

    def remove_replica(self, replica_id: str) -> None:
        """Forgets a replica: its index entries, counters and turn go."""
        slot = self._slot_of(replica_id)
        self._index.remove_replica(slot)
        del self._slot[replica_id]
        self._ids[slot] = None
        position = self._live.index(slot)
        self._live.pop(position)
        if position < self._next:
            self._next -= 1
        self._load[slot] = np.inf

    @property
    def replicas(self) -> tuple[str, ...]:
        """Registered replica ids, in order of joining."""
        return tuple(self._ids[s] for s in self._live)  # type: ignore[misc]

    # -- the index ----------------------------------------------------------------------------

    def apply(self, replica_id: str, batch: KvEventBatch) -> bool:
        """Applies ``batch`` if it is the replica's next one; ignores (True) a batch already
        covered; refuses (False, nothing applied) a batch after a gap: the caller resyncs."""
        slot = self._slot_of(replica_id)
        if batch.seq <= self._seq[slot]:
            return True
        if batch.seq != self._seq[slot] + 1:
            return False
        index = self._index
        for event in batch.events:
            if type(event) is BlockStored:
                index.apply_stored(slot, event.block_hash, event.medium)
            elif type(event) is BlockRemoved:
                index.apply_removed(slot, event.block_hash, event.medium)
            else:  # AllBlocksCleared (a batch holds nothing else)
                index.clear(slot, event.medium)
        self._seq[slot] = batch.seq
        return True

    def resync(self, replica_id: str, snapshot: KvSnapshot) -> None:
        """Replaces the replica's index with ``snapshot``; batches up to ``snapshot.seq`` are then
        ignored. A snapshot older than the batches already applied is ignored (the index, fed
        without gaps, is newer and exact)."""
        slot = self._slot_of(replica_id)
        if snapshot.seq < self._seq[slot]:
            return
        self._index.remove_replica(slot)
        for block_hash, medium in snapshot.blocks:
            self._index.apply_stored(slot, block_hash, medium)
        self._seq[slot] = snapshot.seq

    def applied_seq(self, replica_id: str) -> int:
        """The seq the replica's index is at: ask its publisher for ``since(applied_seq)``."""
        return self._seq[self._slot_of(replica_id)]

    def blocks_of(self, replica_id: str) -> frozenset[tuple[int, str]]:
        """The replica's index: the ``(block_hash, medium)`` pairs the router believes it holds."""
        return frozenset(self._index.blocks_of(self._slot_of(replica_id)))

    # -- load ---------------------------------------------------------------------------------

    def update_load(self, replica_id: str, load: ReplicaLoad) -> None:
        """Takes a replica's load report."""
        slot = self._slot_of(replica_id)
        if not 0 <= load.kv_usage <= 1:
            raise InvalidArgumentError(f"kv_usage must be in [0, 1], got {load.kv_usage!r}")
        if load.num_waiting < 0 or load.num_running < 0:
            raise InvalidArgumentError(f"request counts must be ≥ 0, got {load!r}")
        self._waiting[slot] = load.num_waiting
        self._running[slot] = load.num_running
        self._kv_usage[slot] = load.kv_usage
        self._set_load(slot)

    def finished(self, replica_id: str) -> None:
        """A request routed to the replica has ended."""
        slot = self._slot_of(replica_id)
        if self._outstanding[slot] == 0:
            raise InvalidArgumentError(f"replica {replica_id!r} has no routed request left to finish")
        self._outstanding[slot] -= 1
        self._set_load(slot)

    def load_of(self, replica_id: str) -> float:
        """The replica's load (module doc), in queued requests."""
        return float(self._load[self._slot_of(replica_id)])

    # -- routing ------------------------------------------------------------------------------

    def route(self, token_ids: Sequence[int], cache_salt: str | None = None, exclude: Collection[str] = ()) -> str:
        """The replica to serve a prompt of ``token_ids`` (its blocks hashed with ``cache_salt``),
        never one of ``exclude``; counts the request as outstanding there until
        :meth:`finished`. Raises :class:`NoReplicaError` when no replica is left to choose."""
        excluded = {self._slot[r] for r in exclude if r in self._slot}
        if len(excluded) >= len(self._live):
            raise NoReplicaError(f"no replica to route to: {len(self._live)} registered, {len(excluded)} excluded")
        if self.policy == "round_robin":
            slot = self._round_robin(excluded)
        else:
            load = self._load
            if excluded:
                load = load.copy()
                load[list(excluded)] = np.inf
            slot = int(np.argmin(load))
            if self.policy == "prefix_aware":
                slot = self._prefix_choice(token_ids, cache_salt, load, slot)
        self._outstanding[slot] += 1
        self._set_load(slot)
        return self._ids[slot]  # type: ignore[return-value]

    def _round_robin(self, excluded: set[int]) -> int:
        while True:
            self._next %= len(self._live)
            slot = self._live[self._next]
            self._next += 1
            if slot not in excluded:
                return slot

    def _prefix_choice(self, token_ids: Sequence[int], cache_salt: str | None, load: np.ndarray, least: int) -> int:
        """The slot of least prefix-aware cost, among those holding the prompt's first block and
        ``least`` (the least loaded: the best of those holding nothing)."""
        prompt_blocks = len(token_ids) / self.block_size
        gains = {
            slot: ram + self.disk_weight * disk
            for slot, ram, disk in self._index.longest_prefixes(token_ids, self.block_size, cache_salt)
        }
        if self._mean_prompt_blocks == 0:
            self._mean_prompt_blocks = prompt_blocks
        else:
            self._mean_prompt_blocks += _MEAN_ALPHA * (prompt_blocks - self._mean_prompt_blocks)
        scale = self._mean_prompt_blocks
        best, best_cost, best_gain = least, math.inf, 0.0
        for slot in (least, *gains):
            gain = gains.get(slot, 0.0)
            cost = float(load[slot]) * scale - gain
            if cost < best_cost or (cost == best_cost and gain > best_gain):
                best, best_cost, best_gain = slot, cost, gain
        return best

    # -- internals ----------------------------------------------------------------------------

    def _slot_of(self, replica_id: str) -> int:
        try:
            return self._slot[replica_id]
        except KeyError:
            raise UnknownReplicaError(f"no replica {replica_id!r} in the router") from None

    def _set_load(self, slot: int) -> None:
        waiting = max(self._outstanding[slot] - self._running[slot], self._waiting[slot])
        self._load[slot] = self.queue_weight * waiting + self.kv_weight * self._kv_usage[slot]
