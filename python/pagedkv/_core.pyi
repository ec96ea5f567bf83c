"""Type stubs for the Rust extension ``pagedkv._core``.

Arguments of BlockManager and Scheduler: a wrong type or an out-of-range value raises
``InvalidArgumentError`` naming the argument (never ``TypeError`` / ``OverflowError``) and changes
nothing. An ``int`` is a Python or numpy int, never a bool or a float, within int64: sizes and ids
take ``0..2**63`` (so -1 and 2**63 are refused alike), token ids ``0..2**32``. A ``str`` must be
valid Unicode. ``TokenIds`` are a sequence of such ints or a 1-D integer array, never ``str``,
``bytes`` or a bool array. A size the allocator refuses raises ``MemoryError``. A panic in the core
raises ``pagedkv.errors.InternalError``, and the object it hit refuses every later call with it.
"""

import os
from collections.abc import Sequence
from typing import ClassVar, Literal, TypeAlias

import numpy as np
import numpy.typing as npt
from typing_extensions import Self, final

# Every class is a PyO3 class: not subclassable (``@final``, which implies a disjoint base), and
# constructed by ``__new__`` (PyO3's ``#[new]``), so the stubs declare ``__new__``, never ``__init__``.

__all__ = [
    "__version__",
    "Vocabulary",
    "Grammar",
    "GrammarMatcher",
    "PendingMasks",
    "start_masks",
    "prepared_json_schema",
    "BlockManager",
    "KVCache",
    "GroupSpec",
    "KvSpec",
    "LayerSpec",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "Scheduler",
    "SchedulerOutput",
    "UpdateOutput",
    "ContiguousKV",
    "ReadBandwidthProbe",
    "set_num_threads",
    "get_num_threads",
    "available_isas",
    "available_kernels",
    "default_isas",
    "measure_read_bandwidth",
    "measure_fma_peak",
    "attention_kernel_seconds",
    "Linear",
    "available_linear_kernels",
    "Embedding",
    "DecoderLayer",
    "Decoder",
    "sample_rows",
    "SAMPLING_COLUMNS",
    "SCHEDULER_DEFAULTS",
    "NO_TOKEN",
    "block_hashes",
    "PrefixIndex",
]

__version__: str

# Private: a name of the stub only (the extension has no such attribute); documented as TokenIds above.
_TokenIds: TypeAlias = Sequence[int] | npt.NDArray[np.integer]
# Private too: a KV event as Scheduler.take_kv_events gives it.
_KvEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared

@final
class BlockManager:
    """Paged KV block manager: fixed-size blocks, prefix sharing, copy-on-write. Thread-safe."""

    def __new__(cls, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> Self:
        """``num_blocks`` at most ``2**31 - 1`` (block tables are int32) and ``num_blocks *
        block_size`` within int64 (slot numbers), else InvalidArgumentError."""
    def allocate(self, seq_id: int, token_ids: _TokenIds, cache_salt: str | None = None) -> int:
        """Create ``seq_id`` holding ``token_ids``; return the number of tokens served from the cache."""
    def can_allocate(self, token_ids: _TokenIds, cache_salt: str | None = None) -> bool:
        """Whether ``allocate`` would succeed now, counting evictable prefix hits as used capacity."""
    def cached_prefix_len(self, token_ids: _TokenIds, cache_salt: str | None = None) -> int:
        """Tokens of ``token_ids`` that ``allocate`` would serve from the cache (never all of them)."""
    def append(self, seq_id: int, token_ids: _TokenIds) -> tuple[int, int] | None:
        """Give ``token_ids`` slots; return the copy-on-write op ``(src, dst)`` if the tail was shared."""
    def fork(self, parent_id: int, child_id: int) -> None:
        """Make ``child_id`` share every block of ``parent_id``."""
    def release_before(self, seq_id: int, first_needed: int) -> int:
        """Release the blocks wholly before token ``first_needed`` (a sliding window's; hashed
        ones stay cached), their entries -1; return how many."""
    def free(self, seq_id: int) -> None:
        """Free ``seq_id``: full blocks stay cached for later hits, tail evicted first."""
    def block_table(self, seq_id: int) -> npt.NDArray[np.int32]:
        """Physical block ids of ``seq_id`` in logical order, -1 where a window released one."""
    def num_tokens(self, seq_id: int) -> int:
        """Tokens with a slot in ``seq_id``."""
    def token_ids(self, seq_id: int) -> list[int]:
        """Token ids of ``seq_id``."""
    def block_tables(self, seq_ids: Sequence[int]) -> npt.NDArray[np.int32]:
        """Block tables as one ``[len(seq_ids), max_blocks]`` array padded with -1."""
    def slot_mapping(self, seq_ids: Sequence[int], num_new_tokens: Sequence[int]) -> npt.NDArray[np.int64]:
        """Slots of the last ``num_new_tokens[i]`` tokens of each sequence, concatenated."""
    def stats(self) -> dict[str, int | float]:
        """num_blocks, free_blocks, cached_blocks, used_blocks, usage, prefix_queried_tokens,
        prefix_hit_tokens, allocations, evictions, cow_copies, window_released_blocks."""
    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant."""
    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int:
        """Clean plus evictable cached blocks."""
    def __len__(self) -> int: ...
    def __contains__(self, seq_id: object, /) -> bool:
        """Never raises: anything that is not a valid id (-1, 2**63, a str) is not in it."""

@final
class KVCache:
    """Paged K/V storage of every layer: ``[num_blocks, num_kv_heads, block_size, head_dim]`` tiles.

    Array arguments are read in index order whatever their memory layout (Fortran order, strided,
    reversed or unaligned views are copied to C order first)."""

    def __new__(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str = "float32",
    ) -> Self:
        """Zeroed storage. ``InvalidArgumentError`` for a dimension below 1, ``num_blocks`` above
        2**31 (block tables hold int32 ids) or a total size past ``isize::MAX`` bytes;
        ``MemoryError`` when the memory cannot be allocated."""
    def write(
        self,
        layer: int,
        keys: npt.NDArray[np.float32],
        values: npt.NDArray[np.float32],
        slot_mapping: npt.NDArray[np.int64],
    ) -> None:
        """Store K/V rows ``[n, num_kv_heads, head_dim]`` at ``slot_mapping`` of ``layer``.

        The cache stores finite values only: ``InvalidArgumentError`` for NaN, infinity, or a finite
        value the cache's dtype would round to infinity (beyond ±65504 in float16, about ±3.39e38
        in bfloat16). Nothing is written then."""
    def copy_blocks(self, ops: npt.NDArray[np.integer] | Sequence[Sequence[int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer, in order (copy-on-write ops): a step's
        int64 ``[C, 2]`` ``copy_ops`` or any sequence of ``(src, dst)`` pairs. ``ShapeError`` for a
        row that is not a pair, ``InvalidArgumentError`` for anything else malformed or a block out
        of range; nothing is copied then."""
    def gather(
        self, layer: int, block_table: npt.NDArray[np.integer] | Sequence[int], num_tokens: int
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """Read back a sequence's first ``num_tokens`` K and V rows through its block table (e.g. a
        row of a step's ``block_tables``: entries past the used blocks, such as its -1 padding,
        are never read)."""
    def attention(
        self,
        layer: int,
        query: npt.NDArray[np.float32],
        block_tables: npt.NDArray[np.int32],
        context_lens: npt.NDArray[np.int32],
        query_start_loc: npt.NDArray[np.int32],
        scale: float | None = None,
        kernel: str | None = None,
        *,
        window: int | None = None,
    ) -> npt.NDArray[np.float32]:
        """Paged attention over ``layer``; returns float32 ``[num_tokens, num_heads, head_dim]``.

        ``query`` is float32 ``[num_tokens, num_heads, head_dim]`` (num_heads a multiple of the
        cache's KV heads), ``block_tables`` int32 ``[num_seqs, max_blocks_per_seq]`` (padding never
        read), ``context_lens`` int32 ``[num_seqs]`` (tokens in cache including the new ones),
        ``query_start_loc`` int32 ``[num_seqs + 1]`` (cumulative query offsets from 0). Query j of a
        sequence with nq queries, at position ``p = context_len - nq + j``, attends causally to keys
        ``0..=p``; with ``window`` (a positive int: a sliding-window layer) to the last ``window``
        of them, ``p - window < k <= p``, and the table entries of blocks wholly before every
        window of a sequence are never read (they may hold -1). ``scale`` defaults to
        ``1/sqrt(head_dim)``; ``kernel`` forces "avx2" or "portable". Raises ``ShapeError`` for
        wrong shapes or dtypes and ``InvalidArgumentError`` for out-of-range values (a window of
        0, or not an int). Releases the GIL while computing.
        """
    def fill_random(self, seed: int) -> None:
        """Overwrites all K/V with pseudo-random values in [-1, 1) (for benchmarks)."""
    @property
    def num_layers(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def nbytes(self) -> int: ...

@final
class Scheduler:
    """Continuous-batching scheduler over a paged KV cache (Rust). Each step runs the running
    sequences first (one decode token or the next prompt chunk), then admits waiting requests from
    the head of the queue under ``max_num_batched_tokens``, ``max_num_seqs`` and free blocks;
    preempts by recompute (lowest priority, most recently admitted) when a sequence cannot grow.
    ``policy="priority"``: lower ``priority`` first, aging one level per ``aging_steps`` steps, so a
    request is never queued behind one of priority ``q`` added more than ``(p - q) * aging_steps``
    steps after it. ``schedule`` and ``update`` must alternate and release the GIL. Thread-safe.

    Made with a ``kv_spec``, the scheduler owns the K/V bytes of its pool (the core's
    ``KvRuntime``), reached only through its step awaiting ``update``
    (``SchedulerOutput.write``/``copy_blocks``/``attention``), and may attach a disk tier."""

    def __new__(
        cls,
        num_blocks: int,
        block_size: int = ...,
        max_num_seqs: int = ...,
        max_num_batched_tokens: int = ...,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = ...,
        policy: str = ...,
        aging_steps: int = ...,
        long_prefill_token_threshold: int = ...,
        eos_token_ids: _TokenIds | None = None,
        admission_lookahead_tokens: int | None = ...,
        eviction_policy: str = ...,
        emit_kv_events: bool = ...,
        min_load_blocks: int = ...,
        offload_watermark_blocks: int | None = None,
        kv_spec: KvSpec | None = None,
    ) -> Self:
        """A limit left out takes its default from :data:`SCHEDULER_DEFAULTS` (the core's, set
        once); ``max_model_len`` defaults to the longest sequence the cache holds (the whole cache;
        with a ``kv_spec`` of several KV cache groups, what fits in all of them:
        ``KvSpec.capacity_tokens``) and may not exceed it;
        ``long_prefill_token_threshold`` caps one sequence's prompt tokens per step (0: no cap).
        ``max_model_len`` and ``max_num_batched_tokens`` at most ``2**31 - 1`` (int32 step arrays).
        Sampling any of ``eos_token_ids`` finishes a sequence unless its request sets ``ignore_eos``.
        ``admission_lookahead_tokens`` is the admission headroom: a waiting request is admitted only
        if, with its first chunk allocated, the free blocks still let every running sequence (it
        included) compute the rest of its prompt and then grow that many tokens (capped by its
        ``max_tokens`` and ``max_model_len``); an empty batch admits the head whenever its first
        chunk fits. ``None`` keeps no headroom: admission fills memory that running sequences need
        a step later, and the sequence just admitted is preempted. ``eviction_policy`` picks the
        cached block evicted when memory is needed: ``"lru"`` the least recently released,
        ``"slru"`` (segmented LRU) never-hit blocks before blocks a prefix lookup has hit (in RAM
        and in the disk tier). ``emit_kv_events`` records KV events (``take_kv_events``). With a
        disk tier: a run of fewer than ``min_load_blocks`` consecutive disk hits is recomputed
        instead of loaded; ``offload_watermark_blocks`` clean blocks are kept ahead of need by
        offloading the next eviction victims early (default: one step's token budget in blocks,
        at most a sixteenth of the pool)."""
    def attach_disk_tier(
        self, path: str | os.PathLike[str], capacity_bytes: int, identity: bytes
    ) -> dict[str, int | bool]:
        """Open (or create) the disk tier in directory ``path`` for this scheduler's K/V (it needs
        a ``kv_spec``), holding at most ``capacity_bytes`` of K/V, for the model ``identity``
        names (a tier recorded for another, or whose index is unreadable, is cleared), and attach
        it: evicted cached blocks are offloaded to it (off this thread), prefix hits on it are
        loaded back and verified (a block failing its checksum, tokens or parent is dropped and
        recomputed). Returns ``{"recovered": blocks, "cleared": bool}``. The tier's thread copies
        blocks while steps run; it never meets them, as a step touches K/V only at its own slots
        and tables. Raises, attaching nothing, InvalidArgumentError for a bad argument (an empty
        path, a capacity holding no block or larger than the file system), a scheduler without
        K/V, a tier attached already or a scheduler that has held a block; MemoryError if its
        slot table cannot be allocated; KvTierError if the directory or its files cannot be made,
        opened or locked (another scheduler holds them), or are refused: the directory (created
        0700) must be the user's own, not a symbolic link, writable by no one else; the files
        (0600) are never opened through a symbolic link."""
    def detach_disk_tier(self) -> list[_KvEvent]:
        """Finish the tier's queued writes and loads and close it (the directory may then be
        opened again); cached RAM blocks stay, its figures stay in ``stats()``. Returns its last
        KV events (with ``emit_kv_events``: those not yet taken, then ``AllBlocksCleared("disk")``), to
        publish after ``take_kv_events()``. Without a tier, ``[]``."""
    def flush_disk_tier(self) -> None:
        """Block until the disk tier has finished every queued write and load."""
    def take_kv_events(self) -> list[_KvEvent]:
        """KV events since the last call, in order (none unless ``emit_kv_events``):
        :class:`BlockStored`, :class:`BlockRemoved`, :class:`AllBlocksCleared`; medium ``"ram"``
        or ``"disk"``, hashes those of ``block_hashes`` (group 0's; each block event names its KV
        cache group). Replaying all of them gives ``kv_blocks()``, those of one group
        ``kv_blocks(group)``."""
    def kv_blocks(self, group: int | None = None) -> list[tuple[int, str]]:
        """The ``(block_hash, medium)`` pairs findable now by prefix lookup, of KV cache group
        ``group`` or of every group (None)."""
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: _TokenIds,
        max_tokens: int = 16,
        stop_token_ids: _TokenIds | None = None,
        ignore_eos: bool = False,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        n: int = 1,
    ) -> None:
        """Queue a request. Raises DuplicateSequenceError, or InvalidArgumentError for an empty
        prompt, ``len(prompt) >= max_model_len``, ``max_tokens < 1``, ``n`` outside
        ``1..max_num_seqs``; nothing changes then. ``n > 1`` forks the computed prompt."""
    def abort(self, request_id: str) -> None:
        """Drop a request in any state, freeing every block (UnknownSequenceError if not live)."""
    def finish_sample(self, request_id: str, seq_index: int) -> None:
        """End one sample of a live request before its siblings, freeing its blocks
        (UnknownSequenceError if not live; InvalidArgumentError for its only live sample)."""
    def schedule(self) -> SchedulerOutput:
        """Build the next step. InvalidArgumentError if the previous step was not updated."""
    def update(self, output: SchedulerOutput, sampled_token_ids: _TokenIds) -> UpdateOutput:
        """Append one token per sample (``len == output.num_samples``, else ShapeError), finish
        sequences (stop token, eos unless ignore_eos, max_tokens, max_model_len), free blocks.
        InvalidArgumentError unless ``output`` is the step awaiting update of this scheduler."""
    def has_unfinished(self) -> bool: ...
    def sequence_tokens(self, request_id: str, seq_index: int = 0) -> list[int]:
        """Prompt plus output so far of one sample of a live request."""
    def stats(self) -> dict[str, int | float]:
        """steps, num_running, num_waiting, num_unfinished_requests, scheduled_tokens,
        prefill_tokens, generated_tokens, preemptions, finished_requests, aborted_requests,
        peak_running, prefix_queried_tokens, prefix_hit_tokens (RAM and disk hits),
        prefix_hit_rate, kv_usage, cow_copies, window_released_blocks (blocks a sliding window
        released: every layer sliding), num_loading; with a disk tier (attached, or
        detached since): disk_hits / disk_hit_tokens (blocks admission found only on disk),
        disk_loads (loaded, verified), disk_loads_dropped (recomputed instead), disk_dropped_corrupt (did not verify),
        disk_load_misses (not held, or the job failed),
        disk_offloads_issued, disk_offloads (stored), disk_offloads_lost, disk_evictions_without_offload,
        disk_evictions, disk_bytes_written, disk_bytes_read, disk_blocks (held now),
        disk_jobs_in_flight (offloads and loads queued or under way now)."""
    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant."""
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_loading(self) -> int:
        """Sequences waiting for their blocks to load from the disk tier."""
    @property
    def num_unfinished_requests(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def kv_spec(self) -> KvSpec | None:
        """The model's K/V spec it was made with; None without."""
    @property
    def kv_group_blocks(self) -> list[int]:
        """Blocks each KV cache group's tables hold now, in :attr:`kv_groups` order (one entry,
        every block in use, without a KV spec)."""
    @property
    def kv_groups(self) -> list[GroupSpec]:
        """The KV cache groups derived from its K/V spec (empty without one): each sequence has a
        block table per group, a step's ``slot_mapping`` and ``block_tables`` one per group."""
    def __len__(self) -> int: ...
    def __contains__(self, request_id: object, /) -> bool:
        """Never raises: anything that is not a valid request id is not in it."""

@final
class BlockStored:
    """The block of prefix hash ``block_hash`` (after ``parent_block_hash``, holding ``token_ids``),
    of KV cache group ``group`` (0 unless the model has several), is now findable in ``medium``
    ("ram" or "disk"; any other is ``InvalidArgumentError``)."""

    def __new__(
        cls, block_hash: int, parent_block_hash: int, token_ids: Sequence[int], medium: str, group: int | None = None
    ) -> Self: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...
    def __reduce__(self) -> tuple[type[BlockStored], tuple[int, int, tuple[int, ...], str, int]]: ...
    @property
    def group(self) -> int: ...
    @property
    def block_hash(self) -> int: ...
    @property
    def parent_block_hash(self) -> int: ...
    @property
    def token_ids(self) -> tuple[int, ...]:
        """The block's tokens."""
    @property
    def medium(self) -> str: ...

@final
class BlockRemoved:
    """The block of prefix hash ``block_hash``, of KV cache group ``group``, is no longer findable
    in ``medium``."""

    def __new__(cls, block_hash: int, medium: str, group: int | None = None) -> Self: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...
    def __reduce__(self) -> tuple[type[BlockRemoved], tuple[int, str, int]]: ...
    @property
    def group(self) -> int: ...
    @property
    def block_hash(self) -> int: ...
    @property
    def medium(self) -> str: ...

@final
class AllBlocksCleared:
    """No block is findable in ``medium`` any more."""

    def __new__(cls, medium: str) -> Self: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...
    def __reduce__(self) -> tuple[type[AllBlocksCleared], tuple[str]]: ...
    @property
    def medium(self) -> str: ...

@final
class LayerSpec:
    """What one layer keeps of K/V: ``num_kv_heads`` heads of ``head_dim`` elements, attending over
    every earlier token (``window`` None) or over the last ``window`` tokens (a sliding-window
    layer)."""

    def __new__(cls, num_kv_heads: int, head_dim: int, window: int | None = None) -> Self: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def window(self) -> int | None:
        """Tokens a sliding-window layer attends over, None for full attention."""

@final
class KvSpec:
    """What a model keeps of K/V: one :class:`LayerSpec` per layer, stored as ``dtype``
    ("float32", "float16" or "bfloat16"; default ``SCHEDULER_DEFAULTS["kv_dtype"]``). A scheduler
    given one derives its KV cache groups from it (:attr:`Scheduler.kv_groups`): layers alike in
    attention (full, or one window) share groups, each sequence has a block table per group, and a
    sliding group releases the blocks behind its window. A page holds ``block_size`` tokens of as
    many layers as the rarest kind has; a sliding group carves its pages into blocks of
    ``sliding_block_size`` tokens (a divisor of the block size; default half of it) holding
    proportionally more layers (Gemma 3, blocks of 16: one full group of 3 layers, two sliding
    groups of 6 layers in blocks of 8 and one of 3 in blocks of 16). Every page has one size in
    bytes, so one pool serves all groups. Layers of several K/V shapes are refused
    (InvalidArgumentError)."""

    def __new__(
        cls, layers: Sequence[LayerSpec], dtype: str = ..., *, hybrid: bool = True, sliding_block_size: int | None = None
    ) -> Self: ...
    @staticmethod
    def uniform(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str = ...) -> KvSpec:
        """``num_layers`` alike layers of full attention."""
    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...
    __hash__: ClassVar[None]  # type: ignore[assignment]
    @property
    def layers(self) -> list[LayerSpec]: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def dtype(self) -> str:
        """Storage dtype name."""
    @property
    def hybrid(self) -> bool:
        """Whether each attention kind gets KV cache groups of its own (False: every layer's K/V
        kept whole in one group, sliding layers still attending over their window: the baseline
        of ``bench kv-groups``)."""
    @property
    def sliding_block_size(self) -> int | None:
        """Tokens per block of sliding-window groups, or None for the default (half the block size
        when even)."""
    def capacity_tokens(self, num_blocks: int, block_size: int, max_num_batched_tokens: int) -> int:
        """The longest sequence a cache of ``num_blocks`` blocks of ``block_size`` tokens holds for
        this spec, computing up to ``max_num_batched_tokens`` tokens a step: ``num_blocks *
        block_size`` with one full-attention group; a sliding group holds only its window. Raises
        InvalidArgumentError for a spec a scheduler refuses."""

@final
class GroupSpec:
    """Layers whose K/V one block table per sequence addresses: alike in KV heads, head size and
    window (``layer``; a group of sliding-window layers keeps each sequence's last ``window``
    tokens), numbered ``layers`` (increasing), in blocks of ``block_size`` tokens."""

    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...
    __hash__: ClassVar[None]  # type: ignore[assignment]
    @property
    def layer(self) -> LayerSpec: ...
    @property
    def layers(self) -> list[int]: ...
    @property
    def block_size(self) -> int: ...

@final
class SchedulerOutput:
    """One step (S rows, T tokens, K samples). Arrays are made on first access, without copying.
    Query j of row i sits at position ``context_lens[i] - nq_i + j`` (causal).

    It is also the one way into its scheduler's K/V (a scheduler made with a ``kv_spec``):
    ``write``, ``copy_blocks`` and ``attention`` use the step's own slots and tables, kept in Rust
    (changing the arrays handed out here changes nothing they touch), and only while the step
    awaits ``update``; any other step (updated, or another scheduler's) raises
    ``InvalidArgumentError``, touching nothing, as does a scheduler without K/V."""

    def write(self, layer: int, keys: npt.NDArray[np.float32], values: npt.NDArray[np.float32]) -> None:
        """Store K/V rows ``[num_tokens, num_kv_heads, head_dim]`` of ``layer`` at the step's slots.
        Finite values only, as ``KVCache.write``; nothing is written on an error."""
    def copy_blocks(self) -> None:
        """Apply the step's copy-on-write block copies (before its attention reads the K/V)."""
    def attention(
        self, layer: int, query: npt.NDArray[np.float32], scale: float | None = None, kernel: str | None = None
    ) -> npt.NDArray[np.float32]:
        """Paged attention of ``query`` over ``layer`` through the step's tables (as
        ``KVCache.attention``), over the layer's sliding window when the scheduler's ``kv_spec``
        gives it one (taken from there, never from the caller); returns float32
        ``[num_tokens, num_heads, head_dim]``."""

    @property
    def step(self) -> int:
        """Step number (from 0) within the scheduler that built it."""
    @property
    def input_ids(self) -> npt.NDArray[np.int64]:
        """[T] token ids to run."""
    @property
    def positions(self) -> npt.NDArray[np.int64]:
        """[T] position of each token in its sequence."""
    @property
    def slot_mapping(self) -> npt.NDArray[np.int64]:
        """[T] cache slot (block * block_size + offset) for each token's K/V; with several KV cache
        groups (``num_kv_groups``), [G, T], each group's."""
    @property
    def num_kv_groups(self) -> int:
        """KV cache groups (G): each sequence has a block table per group."""
    @property
    def query_start_loc(self) -> npt.NDArray[np.int32]:
        """[S + 1] row i's tokens are ``query_start_loc[i]:query_start_loc[i + 1]``."""
    @property
    def context_lens(self) -> npt.NDArray[np.int32]:
        """[S] tokens in the cache per row, including this step's."""
    @property
    def block_tables(self) -> npt.NDArray[np.int32]:
        """[S, W] block table per row, padded with -1 (as are blocks a sliding window released);
        with several KV cache groups, [G, S, W], each group's."""
    @property
    def copy_ops(self) -> npt.NDArray[np.int64]:
        """[C, 2] copy-on-write block copies (src, dst), to apply before attention."""
    @property
    def logits_indices(self) -> npt.NDArray[np.int64]:
        """[K] token row whose logits give each sample (repeated for parallel samples)."""
    @property
    def seq_indices(self) -> npt.NDArray[np.uint32]:
        """[S] sample index (0..n) of each row's sequence."""
    @property
    def sample_seq_indices(self) -> npt.NDArray[np.uint32]:
        """[K] sample index of each sample's sequence."""
    @property
    def request_ids(self) -> list[str]:
        """[S] request of each row."""
    @property
    def sample_request_ids(self) -> list[str]:
        """[K] request of each sample."""
    @property
    def events(self) -> list[tuple[str, int, Literal["admitted", "resumed", "preempted"], int]]:
        """Admissions and preemptions of this step, in order: ``(request_id, seq_index, kind,
        prefix_hit_tokens)``; "resumed" is an admission after a preemption, and the hit (prompt
        tokens found in the prefix cache) is 0 for "preempted"."""
    @property
    def num_seqs(self) -> int: ...
    @property
    def num_samples(self) -> int: ...
    @property
    def num_scheduled_tokens(self) -> int: ...
    @property
    def stats(self) -> dict[str, int | float]:
        """num_running, num_waiting, num_preempted, num_admitted, num_scheduled_tokens,
        num_prefill_tokens, prefix_queried_tokens, prefix_hit_tokens, kv_usage."""

@final
class UpdateOutput:
    """What one update produced, one entry per sample (samples of aborted requests dropped).
    Iterates as ``(request_id, seq_index, token_id, finish_reason)`` tuples; finish_reason is None
    or "stop", "length", "max_model_len"."""

    @property
    def request_ids(self) -> list[str]: ...
    @property
    def seq_indices(self) -> npt.NDArray[np.uint32]: ...
    @property
    def token_ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def finish_reasons(self) -> list[str | None]: ...
    @property
    def finished_request_ids(self) -> list[str]:
        """Requests whose every sequence finished in this update."""
    def __len__(self) -> int: ...
    # Iterable through __getitem__ (the sequence protocol; the class defines no __iter__).
    def __getitem__(self, index: int, /) -> tuple[str, int, int, str | None]: ...
# --- attention (functions and classes of src/python/attention.rs) ------------------------------

@final
class ContiguousKV:
    """Contiguous K/V ``[num_seqs, num_kv_heads, max_context, head_dim]`` filled with pseudo-random
    values: the unpaged baseline for benchmarks, running the same loop as ``KVCache.attention``."""

    dtype: str

    def __new__(
        cls, num_seqs: int, num_kv_heads: int, max_context: int, head_dim: int, dtype: str = "float32", seed: int = 0
    ) -> Self:
        """``MemoryError`` when the K/V cannot be allocated."""
    def attention(
        self,
        query: npt.NDArray[np.float32],
        context_lens: npt.NDArray[np.int32],
        query_start_loc: npt.NDArray[np.int32],
        block_size: int = 16,
        scale: float | None = None,
        kernel: str | None = None,
        *,
        window: int | None = None,
    ) -> npt.NDArray[np.float32]:
        """Attention over the first ``context_lens[i]`` rows of each sequence, in tiles of
        ``block_size`` rows; same semantics (``window`` included) and errors as
        ``KVCache.attention``."""

def block_hashes(token_ids: _TokenIds, block_size: int, cache_salt: str | None = None) -> list[int]:
    """128-bit prefix-cache chain hashes (``0..2**128``) of every full block of ``token_ids``, salted by
    ``cache_salt``: exactly the hashes the block manager, the scheduler and KV events use, so a
    router hashes prompts with it. ``InvalidArgumentError`` unless ``block_size`` is positive."""

@final
class PrefixIndex:
    """A router's index: block hash → the replicas (ints in ``0..2**32``) holding it in ``"ram"``
    and on ``"disk"``; finds each replica's longest cached prefix of a prompt. Thread-safe.
    A block hash is an int in ``0..2**128``; a medium other than ``"ram"`` / ``"disk"`` raises
    ``InvalidArgumentError``."""

    def __new__(cls) -> Self:
        """An empty index."""
    def apply_stored(self, replica: int, block_hash: int, medium: str) -> bool:
        """``replica`` now holds ``block_hash`` in ``medium``; whether that is new."""
    def apply_removed(self, replica: int, block_hash: int, medium: str) -> bool:
        """``replica`` no longer holds ``block_hash`` in ``medium``; whether it did."""
    def clear(self, replica: int, medium: str) -> None:
        """``replica`` holds nothing in ``medium`` any more."""
    def remove_replica(self, replica: int) -> None:
        """Forgets ``replica`` and everything it holds."""
    def blocks_of(self, replica: int) -> list[tuple[int, str]]:
        """The ``(block_hash, medium)`` pairs ``replica`` holds, in no order."""
    def longest_prefixes(
        self, token_ids: _TokenIds, block_size: int, cache_salt: str | None = None
    ) -> list[tuple[int, int, int]]:
        """``(replica, ram_blocks, disk_blocks)`` per replica holding the first reusable block of
        ``token_ids`` (hashed as ``block_hashes`` hashes it), by replica: its leading ``ram_blocks``
        in RAM, then ``disk_blocks`` more in some medium. The block of the last token never counts.
        ``InvalidArgumentError`` unless ``block_size`` is positive."""

def set_num_threads(threads: int) -> None:
    """Sets the worker pool's thread count (attention, linear and sampling run on it), 1 to 1024
    (default: ``PAGEDKV_NUM_THREADS`` when within that range, else every CPU).
    ``InvalidArgumentError`` for a count outside it, ``MemoryError`` for one the system cannot
    start; the previous count stays then."""

def get_num_threads() -> int:
    """The worker pool's thread count."""

def available_kernels() -> list[str]:
    """The instruction sets attention has kernels for that this CPU runs, best first, e.g.
    ``["avx2", "portable"]`` (each a ``kernel=`` value)."""

def default_isas() -> list[tuple[str, str]]:
    """What the kernels run on by default: ``[("ceiling", ...), ("attention", ...), ("linear",
    ...), ("quantized", ...), ("sampling", ...)]`` (linear: float weights; quantized: GGUF-format
    weights). The
    ceiling is ``PAGEDKV_ISA`` ("avx512bf16", "avx512vnni", "avx512", "avx2" or "portable") when set, valid and
    available, else the best set this CPU has (read once per process); each family takes the
    best set it has kernels for, at most the ceiling."""

def available_isas() -> list[str]:
    """Every instruction set this CPU runs, best first: the values ``PAGEDKV_ISA`` may take here."""

def measure_read_bandwidth(nbytes: int, sweeps: int = 5) -> list[float]:
    """GB/s of each read-only sweep over a freshly written ``nbytes`` buffer, on the attention
    threads (``MemoryError`` when it cannot be allocated)."""

def measure_fma_peak() -> float:
    """f32 GFLOP/s (an FMA counts 2) of all worker pool threads running a register-only FMA loop."""

@final
class ReadBandwidthProbe:
    """A freshly written buffer whose read-only sweeps measure memory bandwidth on the attention
    threads; keep one and sweep it between the measurements it is compared with."""

    nbytes: int

    def __new__(cls, nbytes: int) -> Self:
        """``MemoryError`` when ``nbytes`` cannot be allocated."""
    def sweep(self) -> float:
        """Reads the whole buffer once; returns GB/s (10^9 bytes per second)."""

def attention_kernel_seconds(
    cache: KVCache,
    layer: int,
    query: npt.NDArray[np.float32],
    block_tables: npt.NDArray[np.int32],
    context_lens: npt.NDArray[np.int32],
    query_start_loc: npt.NDArray[np.int32],
    iterations: int = 100,
    scale: float | None = None,
    *,
    window: int | None = None,
) -> float:
    """Seconds per ``KVCache.attention`` call spent in the kernel alone, timed inside Rust
    (``window`` as there)."""

@final
class Linear:
    """A weight ``W`` ``[in_features, out_features]`` stored as float32, float16 or bfloat16
    (rounded to nearest), or kept in GGUF's quantized formats (:meth:`quantized`), and ``x @ W``
    for float32 ``x`` ``[M, in_features]``, summed in float32 on the worker pool. A C- or
    Fortran-ordered float32 weight is packed without a copy of its own (``w.T`` of an ``[out, in]``
    checkpoint matrix is Fortran-ordered); other layouts are read in C order. ``ShapeError`` for a
    wrong ndim, dtype or extent, ``InvalidArgumentError`` for an unknown dtype, format or kernel.

    A quantized weight's product quantizes each row of ``x`` per 32 values to int8 (scale
    ``max|x|/127``) and takes exact integer dot products with the weight's blocks: the result is
    within ``Σ_blocks scale/2 · Σ|w|`` of the float32 product over the dequantized weight."""

    in_features: int
    out_features: int
    dtype: str
    """"float32", "float16", "bfloat16", or a quantized weight's formats joined by "+"
    ("q4_1", "q5_0+q8_0")."""
    nbytes: int
    kernels: list[str]
    """The kernels this CPU runs for this weight, best first (quantized: "avx512vnni", "avx2",
    "portable"; float: "avx512bf16" (prompts; bf16-rounded activations), "avx512", "avx2",
    "portable")."""

    def __new__(cls, weight: npt.NDArray[np.float32], dtype: str = "float32") -> Self: ...
    @staticmethod
    def quantized(in_features: int, parts: list[tuple[str, npt.NDArray[np.uint8]]]) -> Linear:
        """A weight kept as a GGUF file ships it: ``parts`` are ``(format, rows)`` segments of
        ``W``'s transpose stacked in order, each ``rows`` a uint8 ``[n, row bytes]`` array of whole
        rows of ``in_features`` weights in ``format`` ("q8_0", "q4_0", "q4_1", "q5_0", "q4_k",
        "q6_k"). Several segments make one fused projection of mixed formats."""
    def dequantize_rows(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
        """Rows ``ids`` of a quantized weight's transpose (output features) as float32
        ``[len(ids), in_features]``, bit-exact with ggml's dequantization (a tied embedding
        gathers its rows here); ``InvalidArgumentError`` for a float weight or a row out of range."""
    def __call__(self, x: npt.NDArray[np.float32], kernel: str | None = None) -> npt.NDArray[np.float32]:
        """``x @ W`` as a new float32 ``[M, out_features]`` array; ``kernel`` (one of
        :attr:`kernels`) forces a path (``InvalidArgumentError`` if this CPU cannot run it)."""

def available_linear_kernels() -> list[str]:
    """The instruction sets float-weight linear has kernels for that this CPU runs, best first,
    e.g. ``["avx2", "portable"]`` (a quantized weight's are its :attr:`Linear.kernels`)."""

@final
class Embedding:
    """Token embeddings: a float32 table ``[vocab, hidden]`` (copied once into the core: build it
    as the tensor arrives, then drop the array) or a quantized :class:`Linear` whose rows (output
    features) are gathered, dequantized bit-exactly as ggml does (a tied lm_head's own).
    ``InvalidArgumentError`` for a float :class:`Linear`."""

    shape: tuple[int, int]
    """``(vocab_size, hidden_size)``."""
    nbytes: int
    """Bytes held (a shared quantized weight counts in full)."""

    def __new__(cls, table: npt.NDArray[np.float32] | Linear) -> Self: ...
    def __call__(self, ids: _TokenIds) -> npt.NDArray[np.float32]:
        """The float32 rows ``[len(ids), hidden_size]`` of token ``ids``; ``InvalidArgumentError``
        for an id outside ``0..vocab_size``."""

@final
class DecoderLayer:
    """One layer's weights of a :class:`Decoder`: norms as float32 multipliers (``hidden_size``
    values; ``head_dim`` for the per-head ``q_norm``/``k_norm``), projections as :class:`Linear`
    of ``x @ W`` shapes (``qkv`` ``[hidden, (heads + 2 kv_heads) · head_dim]``, ``o``, ``gate_up``
    ``[hidden, 2 · intermediate]``, ``down``), ``rope`` the index of its set of rotary frequencies.
    The optional norms (Gemma's) are applied where given: per head before the rotation, and to the
    attention's and the MLP's outputs before their residual adds."""

    def __new__(
        cls,
        *,
        input_norm: npt.NDArray[np.float32],
        qkv: Linear,
        o: Linear,
        pre_mlp_norm: npt.NDArray[np.float32],
        gate_up: Linear,
        down: Linear,
        rope: int = 0,
        q_norm: npt.NDArray[np.float32] | None = None,
        k_norm: npt.NDArray[np.float32] | None = None,
        post_attention_norm: npt.NDArray[np.float32] | None = None,
        post_mlp_norm: npt.NDArray[np.float32] | None = None,
    ) -> Self: ...

@final
class Decoder:
    """A pre-norm decoder whose whole forward pass over a step runs in the core, in one call
    (GIL released, on the worker pool throughout): embedding (times ``embedding_scale``); per layer
    RMSNorm → ``qkv`` → per-head norms → rotary embedding (the layer's set of ``rope_frequencies``,
    float64 ``[head_dim // 2]`` each, pairs made of the two halves of a head) → K/V write →
    attention (scaled by ``attention_scale``, over the step's window for the layer) → ``o`` →
    norm → residual → RMSNorm → ``gate_up`` → ``activation`` ("silu" or "gelu_tanh") times up →
    ``down`` → norm → residual; then the final norm and, for :meth:`logits`, ``lm_head``.
    ``InvalidArgumentError`` naming the first weight whose shape the dimensions do not imply.

    A step is a :class:`SchedulerOutput` of a scheduler with K/V, or a
    ``pagedkv.models.CacheStep`` (its ``kv_cache``, ``windows`` and step arrays); anything else is
    ``TypeError``."""

    num_layers: int

    def __new__(
        cls,
        *,
        vocab_size: int,
        hidden_size: int,
        intermediate_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rms_norm_eps: float,
        activation: str,
        attention_scale: float,
        embedding_scale: float,
        max_positions: int,
        rope_frequencies: list[npt.NDArray[np.float64]],
        embedding: Embedding,
        layers: list[DecoderLayer],
        final_norm: npt.NDArray[np.float32],
        lm_head: Linear,
    ) -> Self: ...
    def hidden(self, step: object, rows: _TokenIds) -> npt.NDArray[np.float32]:
        """Runs ``step`` (each layer's K/V written at its slots, then attended through its tables)
        and returns the final-normed hidden states float32 ``[len(rows), hidden_size]`` of token
        ``rows``. ``InvalidArgumentError``, touching no K/V, for a token id outside the vocabulary,
        a position at or past ``max_positions`` or a row outside the step."""
    def logits(self, step: object, rows: _TokenIds) -> npt.NDArray[np.float32]:
        """:meth:`hidden` projected by ``lm_head``: float32 logits ``[len(rows), vocab_size]``."""

SAMPLING_COLUMNS: list[str]
# The defaults of ``Scheduler(...)``, set once in the core (``SchedulerConfig::new``): block_size,
# max_num_seqs, max_num_batched_tokens, enable_prefix_caching, policy, aging_steps,
# long_prefill_token_threshold, admission_lookahead_tokens, eviction_policy, emit_kv_events,
# min_load_blocks.
SCHEDULER_DEFAULTS: dict[str, int | bool | str | None]
"""Column order of ``sample_rows``'s ``params`` matrix (one row of parameters per logits row)."""
NO_TOKEN: int
"""The token ``sample_rows`` gives a row with no token to draw (a NaN, or only -inf)."""

def sample_rows(
    logits: npt.NDArray[np.float32],
    params: npt.NDArray[np.float64],
    history_offsets: npt.NDArray[np.int64],
    history_tokens: npt.NDArray[np.int32],
    history_counts: npt.NDArray[np.int32],
    bias_offsets: npt.NDArray[np.int64],
    bias_tokens: npt.NDArray[np.int32],
    bias_values: npt.NDArray[np.float32],
    masks: npt.NDArray[np.uint32] | None = None,
    mask_rows: npt.NDArray[np.int64] | None = None,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32], npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """One token per row of ``logits`` ``[rows, vocab]`` under that row of ``params`` ``[rows,
    len(SAMPLING_COLUMNS)]``, the rows' token histories in CSR form (``history_offsets`` ``[rows +
    1]`` into ``history_tokens`` and ``history_counts``) and their logit biases likewise
    (``bias_offsets`` into ``bias_tokens`` and ``bias_values``): ``(tokens, logprobs, top_ids,
    top_logprobs)``; unused entries hold -1 and NaN. Rows ``mask_rows`` (distinct) sample only the
    tokens their row of ``masks`` (``[len(mask_rows), ceil(vocab / 32)]``, a grammar's bitmask:
    bit ``t % 32`` of word ``t // 32``) allows. Used by :func:`pagedkv.sampling.sample`."""


@final
class Vocabulary:
    """A tokenizer's tokens as bytes (``tokens[id]``), which of them are special (stand for no
    text), and its end-of-sequence id: what grammars are compiled against."""

    def __new__(cls, tokens: Sequence[bytes], special: Sequence[bool], eos_token_id: int) -> Self: ...
    def __len__(self) -> int: ...


@final
class Grammar:
    """A grammar compiled for a vocabulary, from exactly one of ``json_schema`` (JSON text),
    ``regex``, ``lark`` (llguidance's Lark dialect, start rule ``start``) or ``choice`` (strings).
    A grammar that does not compile, or matches no output, is ``InvalidArgumentError``."""

    def __new__(
        cls,
        vocabulary: Vocabulary,
        *,
        json_schema: str | None = None,
        regex: str | None = None,
        lark: str | None = None,
        choice: Sequence[str] | None = None,
    ) -> Self: ...
    def matcher(self) -> GrammarMatcher:
        """A matcher at the start of an output."""


@final
class GrammarMatcher:
    """One output's position in a grammar: which tokens may come next, and advancing past one."""

    def allowed(self) -> npt.NDArray[np.bool_]:
        """A bool array over the vocabulary: the tokens that may come next (only the
        end-of-sequence token once the output is complete and cannot go on)."""
    def advance(self, token: int) -> None:
        """Moves past ``token``; ``InvalidArgumentError`` (nothing changed) if it may not come next."""
    @property
    def is_accepting(self) -> bool:
        """Whether the output so far is complete."""
    @property
    def is_finished(self) -> bool:
        """Whether the grammar allows nothing more."""


def start_masks(matchers: Sequence[GrammarMatcher]) -> PendingMasks:
    """Starts computing the masks of ``matchers`` (one vocabulary) on the worker pool, returning at
    once: the caller runs the forward pass meanwhile and collects them with ``wait``."""


@final
class PendingMasks:
    """Masks being computed (:func:`start_masks`)."""

    def wait(self) -> tuple[npt.NDArray[np.uint32], list[str | None], float]:
        """Blocks (the GIL released) until every mask is ready: a uint32 array ``[rows, ceil(vocab
        / 32)]`` (bit ``t % 32`` of word ``t // 32`` set when token ``t`` may come), each row's error
        (None, or why its grammar failed: its mask is then all zero), and the seconds spent
        computing them (summed over rows). Once only."""


def prepared_json_schema(schema: str) -> str:
    """A JSON schema (JSON text) as grammars compile it, as JSON text: what to embed in a Lark
    grammar's ``%json`` so that it holds the same output as a ``json_schema`` constraint.
    ``InvalidArgumentError`` for text that is not JSON."""
