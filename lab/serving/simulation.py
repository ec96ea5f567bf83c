"""The four serving policies compared by ``pagedkv bench serve``, built over one KV memory size,
one batching budget and one simulated cost model, each on its own virtual clock."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from lab.serving.replay import PagedPolicy, ReplayResult, ServingPolicy, SimulatedTime, replay
from lab.serving.reservation import ContinuousReservationPolicy, StaticBatchingPolicy
from lab.serving.workload import Workload
from pagedkv.engine import EngineConfig, EngineCore, SimulatedRunner
from pagedkv.errors import InvalidArgumentError
from pagedkv.models.simulated import SimulatedModel, StepCostModel

__all__ = ["POLICIES", "ServingSetup", "make_policy", "simulate"]

STATIC = "static-reservation"
CONTINUOUS = "continuous-reservation"
PAGED = "paged"
PAGED_PREFIX = "paged-prefix-cache"
# In the order of the issue: the seed's static batching, Orca-style, pagedkv, pagedkv + prefix cache.
POLICIES = (STATIC, CONTINUOUS, PAGED, PAGED_PREFIX)


@dataclass(frozen=True)
class ServingSetup:
    """What every policy shares: KV memory (``num_blocks * block_size`` token slots), the longest
    sequence, the per-step sequence cap and token budget, and the model's cost per step."""

    num_blocks: int = 4096
    block_size: int = 16
    max_model_len: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    cost: StepCostModel = field(default_factory=StepCostModel)

    @property
    def kv_capacity_slots(self) -> int:
        return self.num_blocks * self.block_size

    def scheduler_config(self, enable_prefix_caching: bool) -> EngineConfig:
        return EngineConfig(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=enable_prefix_caching,
        )


def make_policy(name: str, setup: ServingSetup, clock: SimulatedTime) -> ServingPolicy:
    """One of :data:`POLICIES` over ``setup``, charging simulated step time to ``clock``."""
    if name in (STATIC, CONTINUOUS):
        kind = StaticBatchingPolicy if name == STATIC else ContinuousReservationPolicy
        return kind(
            setup.kv_capacity_slots,
            setup.max_model_len,
            clock,
            cost=setup.cost,
            max_num_seqs=setup.max_num_seqs,
            max_num_batched_tokens=setup.max_num_batched_tokens,
        )
    if name in (PAGED, PAGED_PREFIX):
        runner = SimulatedRunner(SimulatedModel(cost=setup.cost), clock, max_model_len=setup.max_model_len)
        core = EngineCore(runner, setup.scheduler_config(enable_prefix_caching=name == PAGED_PREFIX), clock=clock)
        return PagedPolicy(name, core, clock)
    raise InvalidArgumentError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}")


def simulate(
    name: str, workload: Workload, setup: ServingSetup, on_progress: Callable[[int], None] | None = None
) -> ReplayResult:
    """Replays ``workload`` through policy ``name`` on a fresh virtual clock."""
    clock = SimulatedTime()
    return replay(make_policy(name, setup, clock), workload.requests, clock, on_progress)
