"""Baselines that reserve KV memory for a request's maximum length, as serving systems did before
paging: every admitted request holds ``max_model_len`` token slots until it releases them.

- :class:`StaticBatchingPolicy` (FasterTransformer-style, and the seed's design): a batch is formed
  from the requests waiting when the previous batch ended, and runs until its last request
  finishes; nobody joins mid-batch and a finished request's reservation is held until then.
- :class:`ContinuousReservationPolicy` (Orca-style): requests join and leave at every iteration,
  but each still reserves ``max_model_len`` slots for its lifetime.

Both run the same iteration as the paged scheduler (running requests first, one decode token or
their next prompt chunk, under the same token budget and sequence cap; then admissions), and
charge each step to the same :class:`~pagedkv.models.simulated.StepCostModel` on the same virtual
clock, so the only difference from paging is how memory is reserved. They are generous to the
static baseline: prompts are not padded to the batch's longest, and finished rows stop computing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import ClassVar

from lab.serving.replay import PolicyTotals, SimulatedTime, StepRecord
from lab.serving.workload import ServingRequest
from pagedkv.engine import RequestMetrics
from pagedkv.errors import InvalidArgumentError
from pagedkv.models.simulated import StepCostModel

__all__ = ["ContinuousReservationPolicy", "StaticBatchingPolicy"]


@dataclass
class _Sequence:
    request: ServingRequest
    metrics: RequestMetrics
    num_computed: int = 0  # prompt tokens computed
    num_output: int = 0  # tokens generated

    @property
    def cached_tokens(self) -> int:
        """Tokens whose K/V is stored: computed prompt tokens and every output token but the last."""
        return self.num_computed + max(0, self.num_output - 1)

    @property
    def finished(self) -> bool:
        return self.num_output >= self.request.max_tokens


class _MaxLengthReservation:
    """Shared machinery; subclasses say whether requests join and leave at every iteration."""

    name: ClassVar[str]
    iteration_level: ClassVar[bool]

    def __init__(
        self,
        kv_capacity_slots: int,
        max_model_len: int,
        clock: SimulatedTime,
        cost: StepCostModel | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
    ) -> None:
        if max_model_len > kv_capacity_slots:
            raise InvalidArgumentError(f"max_model_len {max_model_len} exceeds the KV capacity of {kv_capacity_slots} slots")
        self.kv_capacity_slots = kv_capacity_slots
        self.max_model_len = max_model_len
        self.num_reservations = min(kv_capacity_slots // max_model_len, max_num_seqs)
        self.clock = clock
        self.cost = cost or StepCostModel()
        self.max_num_batched_tokens = max_num_batched_tokens
        self._waiting: deque[_Sequence] = deque()
        self._holders: list[_Sequence] = []  # requests holding a reservation, in admission order
        self._prefill_tokens = 0

    def add_request(self, request: ServingRequest) -> None:
        if request.prompt_len + request.max_tokens > self.max_model_len:
            raise InvalidArgumentError(
                f"request {request.request_id}: {request.prompt_len} + {request.max_tokens} tokens "
                f"exceed max_model_len {self.max_model_len}"
            )
        self._waiting.append(_Sequence(request, RequestMetrics(arrival_time=request.arrival_s)))

    def has_unfinished(self) -> bool:
        return bool(self._waiting) or any(not s.finished for s in self._holders)

    def totals(self) -> PolicyTotals:
        return PolicyTotals(prefill_tokens=self._prefill_tokens, preemptions=0, prefix_queried_tokens=0, prefix_hit_tokens=0)

    def step(self) -> tuple[StepRecord, list[tuple[str, RequestMetrics]]]:
        """One iteration: schedule, sample, charge the modelled time, finish, release."""
        if not self.iteration_level and all(s.finished for s in self._holders):
            self._holders.clear()  # the batch is over: form the next from whoever waits
            while self._waiting and len(self._holders) < self.num_reservations:
                self._holders.append(self._waiting.popleft())
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[_Sequence, int]] = []  # (sequence, tokens this step)
        for seq in self._holders:
            if budget == 0:
                break
            if not seq.finished:
                tokens = self._tokens_for(seq, budget)
                scheduled.append((seq, tokens))
                budget -= tokens
        if self.iteration_level:
            while budget > 0 and self._waiting and len(self._holders) < self.num_reservations:
                seq = self._waiting.popleft()
                self._holders.append(seq)
                tokens = self._tokens_for(seq, budget)
                scheduled.append((seq, tokens))
                budget -= tokens
        if not scheduled:
            raise RuntimeError(f"{self.name}: nothing to schedule while requests are unfinished")
        active = [s for s in self._holders if not s.finished]

        prefill = 0
        sampled: list[_Sequence] = []
        for seq, tokens in scheduled:
            if seq.num_computed < seq.request.prompt_len:
                seq.num_computed += tokens
                prefill += tokens
                if seq.num_computed < seq.request.prompt_len:
                    continue  # a prompt chunk with more to come: nothing to sample yet
            seq.num_output += 1
            sampled.append(seq)
        num_tokens = sum(tokens for _, tokens in scheduled)
        context = sum(seq.cached_tokens for seq, _ in scheduled)
        start = self.clock()
        self.clock.advance(self.cost.step_seconds(num_tokens, context))
        now = self.clock()
        self._prefill_tokens += prefill

        finished = []
        for seq in sampled:
            seq.metrics.num_output_tokens = seq.num_output
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            if seq.finished:
                seq.metrics.finished_time = now
                finished.append((seq.request.request_id, seq.metrics))
        record = StepRecord(
            start_s=start,
            duration_s=now - start,
            num_running=len(active),
            scheduled_tokens=num_tokens,
            prefill_tokens=prefill,
            reserved_slots=len(self._holders) * self.max_model_len,
            live_tokens=sum(s.cached_tokens for s in active),
        )
        if self.iteration_level:
            self._holders = [s for s in self._holders if not s.finished]
        return record, finished

    @staticmethod
    def _tokens_for(seq: _Sequence, budget: int) -> int:
        """The next prompt chunk within ``budget``, or one decode token."""
        remaining_prompt = seq.request.prompt_len - seq.num_computed
        return min(remaining_prompt, budget) if remaining_prompt > 0 else 1


class StaticBatchingPolicy(_MaxLengthReservation):
    """Static batches with max-length reservations (FasterTransformer-style)."""

    name = "static-reservation"
    iteration_level = False


class ContinuousReservationPolicy(_MaxLengthReservation):
    """Iteration-level batching with max-length reservations (Orca-style)."""

    name = "continuous-reservation"
    iteration_level = True
