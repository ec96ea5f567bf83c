"""A model's K/V declared layer by layer (``LayerSpec``, ``KvSpec``) and the KV cache groups a
scheduler derives from it (``Scheduler.kv_groups``): alike layers share a group; a layout the
runtime cannot keep yet (a sliding-window layer, layers of several shapes) is refused, typed,
before anything is allocated."""

from __future__ import annotations

import pytest

from pagedkv import InvalidArgumentError, KvSpec, LayerSpec, Scheduler
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


@pytest.mark.parametrize(("layers", "message"), [
    ([LayerSpec(2, 8), LayerSpec(2, 8, window=4)], "sliding-window layers are not supported"),
    ([LayerSpec(2, 8), LayerSpec(4, 8)], "2 KV cache groups"),
    ([LayerSpec(2, 8, window=0)], "at least one token"),
    ([LayerSpec(0, 8)], "positive"),
    ([], "at least one layer"),
])
def test_layouts_the_runtime_cannot_keep_are_refused(layers: list[LayerSpec], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        Scheduler(num_blocks=8, kv_spec=KvSpec(layers))
