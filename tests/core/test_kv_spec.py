"""A model's K/V declared layer by layer (``LayerSpec``, ``KvSpec``) and the KV cache groups a
scheduler derives from it (``Scheduler.kv_groups``): layers of one attention kind share groups of
as many layers as the rarest kind has, each sequence has a block table per group (a step's arrays
per group), a sliding group keeps only its window and a step's attention applies each layer's
window from the spec; a layout the runtime cannot keep (layers of several shapes) is refused,
typed, before anything is allocated."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import CacheStep, InvalidArgumentError, KVCache, KvSpec, LayerSpec, Scheduler
from support.tier_workload import tiny_model


def test_layer_specs_are_values() -> None:
    full, local = LayerSpec(2, 8), LayerSpec(2, 8, window=512)
    assert full == LayerSpec(2, 8) and full != local and len({full, LayerSpec(2, 8), local}) == 2
    assert (full.window, local.window, local.num_kv_heads, local.head_dim) == (None, 512, 2, 8)
    assert repr(local) == "LayerSpec(num_kv_heads=2, head_dim=8, window=512)"
    spec = KvSpec([full, full], "float16")
    assert spec == KvSpec.uniform(2, 2, 8, "float16") and spec != KvSpec.uniform(2, 2, 8)
    assert (spec.layers, spec.num_layers, spec.dtype) == ([full, full], 2, "float16")


@pytest.mark.parametrize("layers", [[LayerSpec(2, 8), "full"], "layers", 3])
def test_a_spec_of_anything_but_layer_specs_is_refused(layers: object) -> None:
    with pytest.raises(InvalidArgumentError, match="layers"):
        KvSpec(layers)  # type: ignore[arg-type]


def test_a_uniform_model_is_one_group_of_every_layer() -> None:
    s = Scheduler(num_blocks=8, block_size=4, kv_spec=KvSpec.uniform(3, 2, 8))
    [group] = s.kv_groups
    assert (group.layer, group.layers, group.block_size) == (LayerSpec(2, 8), [0, 1, 2], 4)
    assert s.kv_spec == KvSpec.uniform(3, 2, 8)
    assert Scheduler(num_blocks=8).kv_groups == []


def test_the_llama_model_declares_one_full_group() -> None:
    model, _ = tiny_model()
    spec = model.kv_spec("float16")
    c = model.config
    assert spec.layers == [LayerSpec(c.num_kv_heads, c.head_dim)] * c.num_layers
    [group] = Scheduler(num_blocks=8, kv_spec=spec).kv_groups
    assert group.layers == list(range(c.num_layers))


def test_each_attention_kind_has_groups_of_its_own_and_a_step_has_arrays_per_group() -> None:
    # Sliding blocks as large as the pages: no group carves them (see the next test).
    spec = KvSpec([LayerSpec(2, 8, window=4), LayerSpec(2, 8), LayerSpec(2, 8, window=4)], sliding_block_size=4)
    s = Scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=8, kv_spec=spec)
    # The rarest kind (full) has one layer: groups of one layer each, the full one first (group
    # 0, the one a router's hashes find), then in layer order.
    assert [(g.layer, g.layers) for g in s.kv_groups] == [
        (LayerSpec(2, 8), [1]), (LayerSpec(2, 8, window=4), [0]), (LayerSpec(2, 8, window=4), [2])]
    assert s.kv_spec == spec and spec.hybrid
    # Without hybrid groups: one group keeps every layer whole (the baseline).
    whole = KvSpec(spec.layers, hybrid=False)
    assert not whole.hybrid and whole != spec and repr(whole).endswith("hybrid=False)")
    [group] = Scheduler(num_blocks=32, block_size=4, kv_spec=whole).kv_groups
    assert (group.layer, group.layers) == (LayerSpec(2, 8), [0, 1, 2])
    assert whole.capacity_tokens(32, 4, 8) == 32 * 4
    # The default max_model_len is what the three groups hold together: the full group's blocks
    # plus two sliding groups of at most ceil((4 - 1 + 8) / 4) + 1 = 4 blocks each.
    assert spec.capacity_tokens(32, 4, 8) == s.max_model_len == (32 - 2 * 4) * 4
    assert KvSpec.uniform(2, 2, 8).capacity_tokens(32, 4, 8) == 32 * 4
    s.add_request("r", list(range(10)), max_tokens=8)
    step = s.schedule()
    assert step.num_kv_groups == 3
    assert step.slot_mapping.shape == (3, 8) and step.block_tables.shape == (3, 1, 2)
    tables = step.block_tables[:, 0, :]
    assert len({int(b) for b in tables.ravel()}) == 6, "every group has blocks of its own"
    assert np.array_equal(step.slot_mapping // 4, np.repeat(tables, 4, axis=1))
    s.update(step, [])
    while s.has_unfinished():
        step = s.schedule()
        sliding = step.block_tables[1, 0]
        held = int((sliding >= 0).sum())
        assert held <= 4 and np.all(sliding[: len(sliding) - held] == -1), sliding
        assert np.all(step.block_tables[0, 0] >= 0), "the full group holds every block"
        s.update(step, [1] * len(step.logits_indices))
    assert s.stats()["window_released_blocks"] > 0


def test_a_sliding_group_carves_its_pages_into_smaller_blocks_and_attends_through_them() -> None:
    """Pages of 4 tokens of one layer; the two sliding layers share each of their pages in blocks
    of 2 tokens (the default: half the page), so their tables and slots count blocks of 2."""
    heads, dim, window, prompt = 2, 8, 3, 11
    layers = [LayerSpec(heads, dim), LayerSpec(heads, dim, window=window), LayerSpec(heads, dim, window=window)]
    spec = KvSpec(layers, "float32")
    assert spec.sliding_block_size is None and "sliding_block_size" not in repr(spec)
    s = Scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=16, kv_spec=spec)
    assert [(g.layers, g.block_size) for g in s.kv_groups] == [([0], 4), ([1, 2], 2)]
    s.add_request("r", list(range(prompt)), max_tokens=1)
    step = s.schedule()
    # The table is as wide as the smaller blocks need; the full group's is padded.
    assert step.block_tables.shape == (2, 1, 6) and list(step.block_tables[0, 0, 3:]) == [-1] * 3
    for group, size in [(0, 4), (1, 2)]:
        table = step.block_tables[group, 0]
        assert np.array_equal(step.slot_mapping[group], table[np.arange(prompt) // size] * size + np.arange(prompt) % size)
    assert not set(step.block_tables[0, 0, :3]) & set(step.block_tables[1, 0]), "a page serves one group"
    rng = np.random.default_rng(2)
    keys, values, query = (rng.standard_normal((3, prompt, heads, dim)).astype(np.float32) for _ in range(3))
    for layer in range(3):
        step.write(layer, keys[layer], values[layer])
    positions = np.arange(prompt)
    causal = positions[None, :] <= positions[:, None]
    sliding = causal & (positions[None, :] > positions[:, None] - window)
    for layer, visible in [(0, causal), (1, sliding), (2, sliding)]:
        q, k, v = query[layer].astype(np.float64), keys[layer].astype(np.float64), values[layer].astype(np.float64)
        scores = np.einsum("thd,khd->htk", q, k) / np.sqrt(dim)
        scores[:, ~visible] = -np.inf
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        expected = np.einsum("htk,khd->thd", weights / weights.sum(axis=-1, keepdims=True), v)
        # Layers 1 and 2 share pages: each reads its own part, not the other's K/V.
        assert np.abs(step.attention(layer, query[layer]) - expected).max() <= 1e-5, layer
    s.update(step, [1])
    whole = KvSpec(layers, "float32", sliding_block_size=4)
    assert [g.block_size for g in Scheduler(num_blocks=32, block_size=4, kv_spec=whole).kv_groups] == [4, 4, 4]
    for bad in [3, 0, 8]:
        with pytest.raises(InvalidArgumentError, match="must divide"):
            Scheduler(num_blocks=32, block_size=4, kv_spec=KvSpec(layers, sliding_block_size=bad))
    for bad in [-1, 2**64, "2", 2.0, True]:
        with pytest.raises(InvalidArgumentError, match="sliding_block_size"):
            KvSpec(layers, sliding_block_size=bad)


def test_a_steps_attention_applies_the_window_of_its_spec() -> None:
    heads, dim, window, prompt = 2, 8, 3, 10
    spec = KvSpec([LayerSpec(heads, dim), LayerSpec(heads, dim, window=window)], "float32")
    s = Scheduler(num_blocks=16, block_size=4, kv_spec=spec)
    s.add_request("r", list(range(prompt)), max_tokens=2)
    step = s.schedule()
    rng = np.random.default_rng(1)
    keys, values, query = (rng.standard_normal((prompt, heads, dim)).astype(np.float32) for _ in range(3))
    for layer in range(2):
        step.write(layer, keys, values)
    # The dense reference: query p attends to keys p - window < k <= p of the sliding layer.
    positions = np.arange(prompt)
    causal = positions[None, :] <= positions[:, None]
    for layer, visible in [(0, causal), (1, causal & (positions[None, :] > positions[:, None] - window))]:
        scores = np.einsum("thd,khd->htk", query.astype(np.float64), keys.astype(np.float64)) / np.sqrt(dim)
        scores[:, ~visible] = -np.inf
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        expected = np.einsum("htk,khd->thd", weights / weights.sum(axis=-1, keepdims=True), values.astype(np.float64))
        assert np.abs(step.attention(layer, query) - expected).max() <= 1e-5, layer
    assert not np.allclose(step.attention(0, query), step.attention(1, query))
    s.update(step, [1])


@pytest.mark.parametrize("windows", [[3], [3, 0], [None, True], [None, 1.5], "ab", 3])
def test_a_cache_step_takes_one_positive_window_or_none_per_layer(windows: object) -> None:
    with pytest.raises(InvalidArgumentError, match="windows"):
        CacheStep(None, KVCache(2, 8, 4, 2, 8), windows=windows)  # type: ignore[arg-type]


@pytest.mark.parametrize(("layers", "message"), [
    ([LayerSpec(2, 8), LayerSpec(4, 8)], "pages of one size"),
    ([LayerSpec(2, 8, window=0)], "at least one token"),
    ([LayerSpec(0, 8)], "positive"),
    ([], "at least one layer"),
])
def test_layouts_the_runtime_cannot_keep_are_refused(layers: list[LayerSpec], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        Scheduler(num_blocks=8, kv_spec=KvSpec(layers))


def test_bad_hybrid_flags_and_capacity_arguments_are_typed_errors() -> None:
    spec = KvSpec([LayerSpec(2, 8, window=4), LayerSpec(2, 8)])
    with pytest.raises(InvalidArgumentError, match="hybrid"):
        KvSpec(spec.layers, hybrid="yes")  # type: ignore[arg-type]
    for bad in ((-1, 4, 8), (8, 0, 8), (8, 4, 1.5)):
        with pytest.raises(InvalidArgumentError):
            spec.capacity_tokens(*bad)  # type: ignore[arg-type]
    # Sizes at the edge of a machine word saturate instead of wrapping.
    assert spec.capacity_tokens(2**63 - 1, 1, 2**63 - 1) <= 2**63 - 1
