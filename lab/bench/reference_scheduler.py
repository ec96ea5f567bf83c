"""A plain-Python scheduler with the policy of ``pagedkv.Scheduler``, written for comparison.

It covers what the scheduler benchmark exercises: FCFS admission from the queue head, running
sequences first, chunked prefill under a token budget and a sequence cap, prefix caching over
chained block hashes (first registration wins, LRU eviction of unreferenced cached blocks,
tail-first release), preemption by recompute of the most recently admitted sequence, and
finishing on ``max_tokens``. Given the same requests and sampled tokens it makes the same
decisions as the Rust scheduler, so the benchmark can check that the step counts agree.

It is written the way a careful Python implementation would be (dicts, heaps, an OrderedDict
LRU, lists of slots), not deliberately slow.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class RefStep:
    """The batch of one step, as lists (what a Python scheduler would hand to a runner)."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    query_start_loc: list[int] = field(default_factory=lambda: [0])
    context_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    logits_indices: list[int] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_samples(self) -> int:
        return len(self.logits_indices)


class _Seq:
    __slots__ = ("request_id", "order", "tokens", "max_tokens", "num_output", "num_computed", "blocks", "hashes", "prefix_hashes")

    def __init__(self, request_id: str, order: int, prompt: list[int], max_tokens: int) -> None:
        self.request_id = request_id
        self.order = order
        self.tokens = list(prompt)
        self.max_tokens = max_tokens
        self.num_output = 0
        self.num_computed = 0
        self.blocks: list[int] = []  # block table
        self.hashes: list[int] = []  # hashes of the table's full blocks
        self.prefix_hashes: list[int] = []  # hashes of full blocks of tokens[:-1], for lookups


class ReferenceScheduler:
    """FCFS continuous batching over a paged block pool, in plain Python."""

    def __init__(
        self,
        num_blocks: int,
        *,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,  # the limits as the benchmark gives the Rust scheduler: no defaults of its own
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.max_model_len = max_model_len or num_blocks * block_size
        self.caching = enable_prefix_caching
        self.chunk_cap = long_prefill_token_threshold or max_num_batched_tokens
        self.free: list[int] = list(range(num_blocks))
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached blocks with no reference
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block
        self.waiting: list[tuple[int, _Seq]] = []  # heap by add order
        self.running: list[_Seq] = []  # admission order; the back is the next victim
        self.requests: dict[str, _Seq] = {}
        self.order = 0
        self.pending: list[_Seq] | None = None
        self.steps = 0
        self.preemptions = 0
        self.generated = 0
        self.queried = 0
        self.hits = 0
        self.peak_running = 0

    # -- block pool -------------------------------------------------------------------------
    def _available(self) -> int:
        return len(self.free) + len(self.lru)

    def _allocate(self) -> int:
        if self.free:
            block = self.free.pop()
        else:
            block, _ = self.lru.popitem(last=False)
            del self.cached[self.block_hash[block]]
            self.block_hash[block] = None
        self.ref[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            if self.block_hash[block] is not None:
                self.lru[block] = None
            else:
                self.free.append(block)

    def _grow(self, seq: _Seq, start: int, end: int) -> None:
        """Gives tokens ``start:end`` slots, registering each block as it fills."""
        bs = self.block_size
        for position in range(start, end):
            if position % bs == 0:
                seq.blocks.append(self._allocate())
            if position % bs == bs - 1:
                parent = seq.hashes[-1] if seq.hashes else 0
                digest = hash((parent, tuple(seq.tokens[position + 1 - bs : position + 1])))
                seq.hashes.append(digest)
                block = seq.blocks[-1]
                if self.caching and self.block_hash[block] is None and digest not in self.cached:
                    self.cached[digest] = block
                    self.block_hash[block] = digest

    def _free_seq(self, seq: _Seq) -> None:
        for block in reversed(seq.blocks):
            self._release(block)
        seq.blocks, seq.hashes, seq.num_computed = [], [], 0

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> None:
        if request_id in self.requests:
            raise ValueError(f"duplicate request {request_id!r}")
        if not prompt_token_ids or len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"request {request_id!r}: prompt length {len(prompt_token_ids)} not allowed")
        seq = _Seq(request_id, self.order, prompt_token_ids, max_tokens)
        self.order += 1
        self.requests[request_id] = seq
        heapq.heappush(self.waiting, (seq.order, seq))

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> RefStep:
        if self.pending is not None:
            raise RuntimeError("update() the previous step first")
        bs = self.block_size
        budget = self.budget
        rows: list[tuple[_Seq, int, int]] = []
        preempted = 0
        cursor = 0
        while cursor < len(self.running) and budget > 0:
            seq = self.running[cursor]
            start = seq.num_computed
            length = min(len(seq.tokens) - start, self.chunk_cap, budget)
            needed = -(-(start + length) // bs) - len(seq.blocks)
            while needed > self._available():
                victim = self.running.pop()
                self._free_seq(victim)
                heapq.heappush(self.waiting, (victim.order, victim))
                preempted += 1
                if victim is seq:
                    break
            else:
                self._grow(seq, start, start + length)
                seq.num_computed += length
                budget -= length
                rows.append((seq, start, length))
                cursor += 1
                continue
            break
        if not preempted:
            while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0][1]
                num_tokens = len(seq.tokens)
                hits: list[int] = []
                if self.caching:
                    full = (num_tokens - 1) // bs
                    parent = seq.prefix_hashes[-1] if seq.prefix_hashes else 0
                    for b in range(len(seq.prefix_hashes), full):
                        parent = hash((parent, tuple(seq.tokens[b * bs : (b + 1) * bs])))
                        seq.prefix_hashes.append(parent)
                    for digest in seq.prefix_hashes[:full]:
                        block = self.cached.get(digest)
                        if block is None:
                            break
                        hits.append(block)
                cached = len(hits) * bs
                length = min(num_tokens - cached, self.chunk_cap, budget)
                revived = sum(1 for b in hits if b in self.lru)
                if -(-(cached + length) // bs) - len(hits) + revived > self._available():
                    break
                heapq.heappop(self.waiting)
                for block in hits:
                    if self.ref[block] == 0:
                        del self.lru[block]
                    self.ref[block] += 1
                seq.blocks = hits
                seq.hashes = seq.prefix_hashes[: len(hits)]
                self._grow(seq, cached, cached + length)
                seq.num_computed = cached + length
                self.queried += num_tokens
                self.hits += cached
                self.running.append(seq)
                budget -= length
                rows.append((seq, cached, length))

        step = RefStep(num_preempted=preempted)
        samplers: list[_Seq] = []
        for seq, start, length in rows:
            end = start + length
            step.input_ids.extend(seq.tokens[start:end])
            step.positions.extend(range(start, end))
            blocks = seq.blocks
            step.slot_mapping.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            step.query_start_loc.append(len(step.input_ids))
            step.context_lens.append(end)
            step.block_tables.append(list(blocks))
            step.request_ids.append(seq.request_id)
            if end == len(seq.tokens):
                step.logits_indices.append(len(step.input_ids) - 1)
                samplers.append(seq)
        width = max((len(t) for t in step.block_tables), default=0)
        for table in step.block_tables:
            table.extend([-1] * (width - len(table)))
        self.preemptions += preempted
        self.peak_running = max(self.peak_running, len(self.running))
        self.steps += 1
        self.pending = samplers
        return step

    def update(self, step: RefStep, sampled_token_ids: list[int]) -> list[tuple[str, int, str | None]]:
        samplers = self.pending
        if samplers is None or len(sampled_token_ids) != len(samplers):
            raise ValueError("update() needs one sampled token per sample of the pending step")
        self.pending = None
        produced = []
        finished = False
        for seq, token in zip(samplers, sampled_token_ids, strict=True):
            seq.tokens.append(token)
            seq.num_output += 1
            reason = None
            if seq.num_output >= seq.max_tokens:
                reason = "length"
            elif len(seq.tokens) >= self.max_model_len:
                reason = "max_model_len"
            produced.append((seq.request_id, token, reason))
            if reason is not None:
                self._free_seq(seq)
                del self.requests[seq.request_id]
                finished = True
        self.generated += len(produced)
        if finished:
            self.running = [s for s in self.running if s.request_id in self.requests]
        return produced

    @property
    def prefix_hit_rate(self) -> float:
        return self.hits / self.queried if self.queried else 0.0
