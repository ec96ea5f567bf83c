"""Type stubs of the Rust extension ``pagedkv._core``.

Sections are added by the module that owns them; other classes are described by their owners.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import numpy.typing as npt

__version__: str

# --- attention -------------------------------------------------------------------------------

class KVCache:
    """Paged K/V storage for all layers of a model, owned by Rust (attention part of the stub)."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    nbytes: int

    def __init__(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: str = "float32"
    ) -> None: ...
    def write(
        self, layer: int, keys: npt.NDArray[np.float32], values: npt.NDArray[np.float32], slot_mapping: npt.NDArray[np.int64]
    ) -> None: ...
    def attention(
        self,
        layer: int,
        query: npt.NDArray[np.float32],
        block_tables: npt.NDArray[np.int32],
        context_lens: npt.NDArray[np.int32],
        query_start_loc: npt.NDArray[np.int32],
        scale: Optional[float] = None,
        kernel: Optional[str] = None,
    ) -> npt.NDArray[np.float32]:
        """Paged attention over ``layer``; returns float32 ``[num_tokens, num_heads, head_dim]``.

        ``query`` is float32 ``[num_tokens, num_heads, head_dim]`` (num_heads a multiple of the
        cache's KV heads), ``block_tables`` int32 ``[num_seqs, max_blocks_per_seq]`` (padding never
        read), ``context_lens`` int32 ``[num_seqs]`` (tokens in cache including the new ones),
        ``query_start_loc`` int32 ``[num_seqs + 1]`` (cumulative query offsets from 0). Query j of a
        sequence with nq queries attends causally to keys ``0..=context_len - nq + j``. ``scale``
        defaults to ``1/sqrt(head_dim)``; ``kernel`` forces "avx2" or "portable". Raises
        ``ShapeError`` for wrong shapes or dtypes and ``InvalidArgumentError`` for out-of-range
        values. Releases the GIL while computing.
        """
    def fill_random(self, seed: int) -> None:
        """Overwrites all K/V with pseudo-random values in [-1, 1) (for benchmarks)."""

class ContiguousKV:
    """Contiguous K/V ``[num_seqs, num_kv_heads, max_context, head_dim]`` filled with pseudo-random
    values: the unpaged baseline for benchmarks, running the same loop as ``KVCache.attention``."""

    dtype: str

    def __init__(
        self, num_seqs: int, num_kv_heads: int, max_context: int, head_dim: int, dtype: str = "float32", seed: int = 0
    ) -> None: ...
    def attention(
        self,
        query: npt.NDArray[np.float32],
        context_lens: npt.NDArray[np.int32],
        query_start_loc: npt.NDArray[np.int32],
        block_size: int = 16,
        scale: Optional[float] = None,
        kernel: Optional[str] = None,
    ) -> npt.NDArray[np.float32]:
        """Attention over the first ``context_lens[i]`` rows of each sequence, in tiles of
        ``block_size`` rows; same semantics and errors as ``KVCache.attention``."""

def set_num_threads(threads: int) -> None:
    """Sets the attention thread count (default: ``PAGEDKV_NUM_THREADS``, else every CPU)."""

def get_num_threads() -> int:
    """The attention thread count."""

def available_kernels() -> list[str]:
    """Kernel paths this CPU runs, fastest first, e.g. ``["avx2", "portable"]``."""

def measure_read_bandwidth(nbytes: int, sweeps: int = 5) -> list[float]:
    """GB/s of each read-only sweep over a freshly written ``nbytes`` buffer, on the attention threads."""

def attention_kernel_seconds(
    cache: KVCache,
    layer: int,
    query: npt.NDArray[np.float32],
    block_tables: npt.NDArray[np.int32],
    context_lens: npt.NDArray[np.int32],
    query_start_loc: npt.NDArray[np.int32],
    iterations: int = 100,
    scale: Optional[float] = None,
) -> float:
    """Seconds per ``KVCache.attention`` call spent in the kernel alone, timed inside Rust."""
