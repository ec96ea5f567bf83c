"""An engine's configuration: its memory and batching limits, its disk tier and its KV events.

Invariants: an :class:`EngineConfig` is frozen and checks nothing itself but the disk tier's
pairing of path and size (:meth:`EngineConfig.disk_tier`); the scheduler and the core validate every
value when an engine is built from it. Every default a scheduler has is the scheduler's
(:data:`pagedkv._core.SCHEDULER_DEFAULTS`, set once in the core); only what a scheduler does not
have (the pool's size, the disk tier) is set here. Every option the scheduler has is a field of
the same name (:meth:`EngineConfig.scheduler_options` passes them on, so no list of them is written
twice). The command line's flags take their defaults from this class.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from pagedkv._core import SCHEDULER_DEFAULTS
from pagedkv.errors import InvalidArgumentError

__all__ = ["DEFAULT_KV_DISK_BYTES", "EngineConfig"]

_SCHEDULER = SCHEDULER_DEFAULTS

# The disk tier's capacity when only its directory is given: 1 GiB, 1456 blocks (23k tokens) of
# SmolLM2-135M in float32 (30 layers x 3 KV heads x 64 dims x K and V x 16 tokens x 4 B = 737 kB).
DEFAULT_KV_DISK_BYTES = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    """Memory and batching limits of an engine."""

    # 1024 blocks of 16 tokens: 16k tokens, 754 MB of SmolLM2-135M's KV in float32.
    num_blocks: int = 1024
    block_size: int = _SCHEDULER["block_size"]
    max_num_seqs: int = _SCHEDULER["max_num_seqs"]
    max_num_batched_tokens: int = _SCHEDULER["max_num_batched_tokens"]
    # None: the model's longest position, capped by the cache; more than the model's is refused.
    max_model_len: int | None = None
    enable_prefix_caching: bool = _SCHEDULER["enable_prefix_caching"]
    policy: str = _SCHEDULER["policy"]
    # With policy "priority": a waiting request gains a priority level every this many steps.
    aging_steps: int = _SCHEDULER["aging_steps"]
    long_prefill_token_threshold: int = _SCHEDULER["long_prefill_token_threshold"]
    # Admission headroom: admit a waiting request only if the running sequences (and it) can still
    # finish their prompts and grow this many tokens each; None admits whenever the first chunk
    # fits now (memory fills, and growth then preempts the request just admitted). See Scheduler.
    admission_lookahead_tokens: int | None = _SCHEDULER["admission_lookahead_tokens"]
    # "lru" or "slru" (segmented LRU: cached blocks a prefix lookup hit outlive never-hit ones;
    # the core's default, and why, at DEFAULT_EVICTION_POLICY in src/scheduler/mod.rs).
    eviction_policy: str = _SCHEDULER["eviction_policy"]
    kv_dtype: str = _SCHEDULER["kv_dtype"]
    # The disk tier (issue 13): evicted cached blocks are offloaded to a store in this directory
    # (created if missing) and loaded back on a prefix hit, across restarts. None: RAM only.
    kv_disk_path: str | Path | None = None
    # The tier's capacity in bytes of K/V data (None with a path: DEFAULT_KV_DISK_BYTES); a size
    # without a path is refused.
    kv_disk_bytes: int | None = None
    # With a disk tier: clean RAM blocks kept ahead of need by offloading the next eviction
    # victims early (None: the scheduler's default, one step's token budget in blocks, at most a
    # sixteenth of the pool); an allocation finding no clean block drops a cached block unsaved.
    offload_watermark_blocks: int | None = None
    # With a disk tier: a run of fewer disk hits than this is recomputed instead of loaded.
    min_load_blocks: int = _SCHEDULER["min_load_blocks"]
    # Record KV events (BlockStored / BlockRemoved / AllBlocksCleared, per medium) for a router:
    # EngineCore.kv_events publishes them after every step. Off: nothing is recorded.
    emit_kv_events: bool = _SCHEDULER["emit_kv_events"]
    # A model with sliding-window layers (Gemma 3) keeps their K/V in KV cache groups of their own,
    # which release the blocks that left the window (KvSpec.hybrid). False keeps every layer's K/V
    # whole in one group: the baseline `python -m lab bench kv-groups` measures against.
    hybrid_kv_cache: bool = True
    # Tokens per block of the sliding-window groups, a divisor of block_size (KvSpec
    # .sliding_block_size): their pages carved into smaller blocks of more layers, halving the
    # slots a window wastes at its ends. None: half of block_size (chosen by measurement, see
    # `default_sliding_block_size` in src/kv/spec.rs).
    sliding_block_size: int | None = None

    def scheduler_options(self) -> dict[str, object]:
        """The scheduler's options as configured, by the scheduler's names: every option
        :data:`~pagedkv._core.SCHEDULER_DEFAULTS` names but the KV dtype (which goes into the
        model's KV spec), the pool's size, the longest sequence and the offload watermark."""
        names = (SCHEDULER_DEFAULTS.keys() - {"kv_dtype"}) | {"num_blocks", "max_model_len", "offload_watermark_blocks"}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in names}

    def disk_tier(self) -> tuple[str | Path, int] | None:
        """The disk tier's directory (as given: ``Path("")`` would turn an empty path, which the
        core refuses, into the current directory) and capacity, or None without one. Raises
        :class:`InvalidArgumentError` for a capacity without a directory, or a value of the wrong
        type (the core checks the size's range and the directory)."""
        if self.kv_disk_path is None:
            if self.kv_disk_bytes is not None:
                raise InvalidArgumentError("kv_disk_bytes needs kv_disk_path (the directory of the disk tier)")
            return None
        if not isinstance(self.kv_disk_path, (str, Path)):
            raise InvalidArgumentError(f"kv_disk_path must be a str or Path, got {type(self.kv_disk_path).__name__}")
        capacity = DEFAULT_KV_DISK_BYTES if self.kv_disk_bytes is None else self.kv_disk_bytes
        return self.kv_disk_path, capacity
