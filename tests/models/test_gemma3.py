"""Gemma 3 on the paged cache against a dense float64 reference written here, on a tiny random
model whose window (5 tokens) is smaller than a block (4 tokens) twice over: prefill, decode and
the engine's batched, chunked runs all see exactly the last ``window`` tokens on local layers and
every token on global ones. The real model's parity with transformers is test_gemma3_parity.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from pagedkv import block_hashes
from pagedkv.engine import Engine, EngineConfig
from pagedkv.errors import InvalidArgumentError
from pagedkv.models import Gemma3Config, Gemma3Model
from pagedkv.models.gemma3 import GEMMA3_LAYER_TENSORS, expected_gemma3_shape
from pagedkv.sampling import SamplingParams
from pagedkv.text.tokenizer import ByteTokenizer
from support.prefill import prefill_logits

CONFIG = Gemma3Config(vocab_size=300, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=2, num_kv_heads=1,
                      head_dim=16, sliding_window=5, sliding_window_pattern=2, rope_theta=1e6, rope_local_theta=1e4,
                      query_pre_attn_scalar=16.0, max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2,))


def random_tensors(config: Gemma3Config, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    names += [f"model.layers.{i}.{suffix}" for i in range(config.num_layers) for suffix in GEMMA3_LAYER_TENSORS.values()]
    tensors = {}
    for name in names:
        shape = expected_gemma3_shape(config, name)
        assert shape is not None
        scale = 0.1 if name.endswith("norm.weight") else (1.0 if len(shape) == 1 or "embed" in name else 1 / math.sqrt(shape[1]))
        tensors[name] = (rng.standard_normal(shape) * scale).astype(np.float32)
    return tensors


def dense_logits(config: Gemma3Config, t: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """The whole sequence recomputed in float64, windows as a mask (transformers' definition:
    key k is seen from query q when q - window < k <= q)."""
    c = config
    n = len(tokens)

    def norm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.rms_norm_eps) * (1 + w.astype(np.float64))

    def rope(x: np.ndarray, theta: float) -> np.ndarray:  # [n, heads, d], half-split pairs as a complex rotation
        half = c.head_dim // 2
        angle = np.arange(n)[:, None] * theta ** (-np.arange(half) * 2 / c.head_dim)[None, :]
        z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * angle)[:, None, :]
        return np.concatenate([z.real, z.imag], axis=-1)

    def w(name: str) -> np.ndarray:
        return t[name].astype(np.float64)

    x = w("model.embed_tokens.weight")[tokens] * math.sqrt(c.hidden_size)
    q_pos, k_pos = np.arange(n)[:, None], np.arange(n)[None, :]
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        sliding = (i + 1) % c.sliding_window_pattern != 0
        visible = (k_pos <= q_pos) & ((q_pos - k_pos < c.sliding_window) if sliding else True)
        h = norm(x, w(p + "input_layernorm.weight"))
        q = (h @ w(p + "self_attn.q_proj.weight").T).reshape(n, c.num_heads, c.head_dim)
        k = (h @ w(p + "self_attn.k_proj.weight").T).reshape(n, c.num_kv_heads, c.head_dim)
        v = (h @ w(p + "self_attn.v_proj.weight").T).reshape(n, c.num_kv_heads, c.head_dim)
        theta = c.rope_local_theta if sliding else c.rope_theta
        q = rope(norm(q, w(p + "self_attn.q_norm.weight")), theta)
        k = rope(norm(k, w(p + "self_attn.k_norm.weight")), theta)
        group = c.num_heads // c.num_kv_heads
        out = np.empty((n, c.num_heads, c.head_dim))
        for head in range(c.num_heads):
            scores = q[:, head] @ k[:, head // group].T / math.sqrt(c.query_pre_attn_scalar)
            scores = np.where(visible, scores, -np.inf)
            weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
            out[:, head] = (weights / weights.sum(axis=-1, keepdims=True)) @ v[:, head // group]
        x = x + norm(out.reshape(n, -1) @ w(p + "self_attn.o_proj.weight").T, w(p + "post_attention_layernorm.weight"))
        h = norm(x, w(p + "pre_feedforward_layernorm.weight"))
        gate, up = h @ w(p + "mlp.gate_proj.weight").T, h @ w(p + "mlp.up_proj.weight").T
        gelu = 0.5 * gate * (1 + np.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)))
        x = x + norm((gelu * up) @ w(p + "mlp.down_proj.weight").T, w(p + "post_feedforward_layernorm.weight"))
    return norm(x, w("model.norm.weight")) @ w("model.embed_tokens.weight").T


@pytest.fixture(scope="module")
def tiny():
    tensors = random_tensors(CONFIG)
    return Gemma3Model(CONFIG, tensors.items()), tensors


def test_prefill_matches_the_dense_reference_past_the_window(tiny):
    model, tensors = tiny
    tokens = list(np.random.default_rng(1).integers(3, CONFIG.vocab_size, 23))
    np.testing.assert_allclose(prefill_logits(model, tokens), dense_logits(CONFIG, tensors, tokens), atol=2e-4, rtol=1e-4)


def test_the_window_matters(tiny):
    """The same model with a window wider than the prompt gives other logits past the window:
    the comparison above could not pass with the window ignored."""
    model, tensors = tiny
    tokens = list(np.random.default_rng(1).integers(3, CONFIG.vocab_size, 23))
    wide = CONFIG.replace(sliding_window=64)
    assert not np.allclose(dense_logits(wide, tensors, tokens)[-1], dense_logits(CONFIG, tensors, tokens)[-1], atol=1e-2)
    np.testing.assert_allclose(prefill_logits(Gemma3Model(wide, tensors.items()), tokens)[:5],
                               prefill_logits(model, tokens)[:5], atol=1e-5)


@pytest.mark.parametrize("hybrid", [True, False])
def test_the_engine_decodes_batched_chunked_prompts_as_the_reference_does(tiny, hybrid):
    model, tensors = tiny
    rng = np.random.default_rng(2)
    prompts = [list(map(int, rng.integers(3, CONFIG.vocab_size, n))) for n in (3, 9, 17, 30)]

    def reference_greedy(prompt: list[int], steps: int) -> list[int]:
        tokens = list(prompt)
        for _ in range(steps):
            tokens.append(int(np.argmax(dense_logits(CONFIG, tensors, tokens)[-1])))
        return tokens[len(prompt):]

    config = EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=7, hybrid_kv_cache=hybrid)
    engine = Engine(model, ByteTokenizer(), config)
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        handles = [engine.submit(prompt, params) for prompt in prompts]
        outputs = [handle.result(timeout=120).outputs[0].token_ids for handle in handles]
        groups, stats, metrics = engine.core.kv_groups(), engine.stats(), engine.metrics.text()
    finally:
        engine.shutdown(timeout=60)
    for prompt, got in zip(prompts, outputs, strict=True):
        assert got == reference_greedy(prompt, 12)
    # A hybrid cache: the two sliding layers' group released blocks behind its window; with every
    # request done, no group holds a block, and each has its own usage series. Without: one group
    # keeps every layer's K/V whole (the sliding layers still attend over their window: same tokens).
    expected = [([1, 3], "full"), ([0, 2], "sliding:5")] if hybrid else [([0, 1, 2, 3], "full")]
    assert [(g.layers, g.attention, g.blocks_in_use) for g in groups] == [(*group, 0) for group in expected]
    assert all(g.block_size == 4 for g in groups)  # 2 sliding layers: too few to carve pages of 4
    assert (stats["window_released_blocks"] > 0) == hybrid
    for index, (_, kind) in enumerate(expected):
        assert f'kv_cache_group_usage_perc{{attention="{kind}",group="{index}",model_name=' in metrics


def test_the_engine_publishes_the_kv_events_of_the_full_group_alone(tiny):
    """Group 0 is the full group: the engine publishes its blocks (hashed as a router hashes a
    prompt) and none of the sliding group's, in its events and its snapshot alike."""
    model, _ = tiny
    engine = Engine(model, ByteTokenizer(), EngineConfig(num_blocks=64, block_size=4, emit_kv_events=True))
    batches = []
    engine.core.kv_events.subscribe(batches.append)
    prompt = list(map(int, np.random.default_rng(5).integers(3, CONFIG.vocab_size, 18)))
    try:
        engine.submit(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)).result(timeout=120)
        snapshot = engine.core.kv_snapshot()
        scheduler = engine.core.scheduler
        full, sliding = scheduler.kv_blocks(0), scheduler.kv_blocks(1)
    finally:
        engine.shutdown(timeout=60)
    events = [event for batch in batches for event in batch.events]
    assert events and all(event.group == 0 for event in events)
    assert snapshot.blocks == set(full) and sliding and not snapshot.blocks & set(sliding)
    # The prompt's 4 full blocks, as a router hashes them (and a fifth holding 3 sampled tokens).
    assert set(block_hashes(prompt, 4)) <= {h for h, _ in snapshot.blocks} and len(snapshot.blocks) == 5


def test_a_model_of_only_sliding_layers_releases_the_blocks_behind_its_window():
    """With every layer sliding, the scheduler keeps only the window's blocks of each sequence:
    the tokens stay the reference's while blocks are released (and the tables show -1)."""
    config = CONFIG.replace(sliding_window_pattern=CONFIG.num_layers + 1)
    tensors = random_tensors(config, seed=3)
    model = Gemma3Model(config, tensors.items())
    assert {layer.window for layer in model.kv_spec().layers} == {5}
    prompt = list(map(int, np.random.default_rng(4).integers(3, config.vocab_size, 21)))
    engine = Engine(model, ByteTokenizer(), EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=6))
    try:
        got = engine.submit(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)).result(timeout=120)
        stats = engine.stats()
    finally:
        engine.shutdown(timeout=60)
    tokens = list(prompt)
    for _ in range(16):
        tokens.append(int(np.argmax(dense_logits(config, tensors, tokens)[-1])))
    assert got.outputs[0].token_ids == tokens[len(prompt):]
    assert stats["window_released_blocks"] >= (21 + 15 - 5) // 4 - 1


def test_the_kv_spec_declares_each_layers_window(tiny):
    model, _ = tiny
    assert [layer.window for layer in model.kv_spec().layers] == [5, None, 5, None]


@pytest.mark.parametrize("change", [{"sliding_window": 0}, {"num_kv_heads": 3}, {"head_dim": 15}, {"rope_local_theta": -1.0},
                                    {"eos_token_ids": (300,)}])
def test_an_invalid_config_is_refused(change):
    with pytest.raises(InvalidArgumentError):
        CONFIG.replace(**change)


def test_a_misshapen_or_missing_tensor_is_refused():
    tensors = random_tensors(CONFIG)
    with pytest.raises(InvalidArgumentError, match="tensors missing: model.layers.3"):
        Gemma3Model(CONFIG, ((n, a) for n, a in tensors.items() if not n.startswith("model.layers.3.")))
    tensors["model.norm.weight"] = np.ones(7, np.float32)
    with pytest.raises(InvalidArgumentError, match="model.norm.weight has shape"):
        Gemma3Model(CONFIG, tensors.items())


@pytest.mark.parametrize("hybrid", ["no", 1, None])
def test_hybrid_kv_cache_must_be_a_bool(tiny, hybrid):
    model, _ = tiny
    with pytest.raises(InvalidArgumentError, match="hybrid_kv_cache"):
        Engine(model, ByteTokenizer(), EngineConfig(num_blocks=64, block_size=4, hybrid_kv_cache=hybrid))


def test_the_command_line_turns_the_hybrid_cache_off():
    import argparse

    from pagedkv.cli import add_engine_arguments, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_kwargs(parser.parse_args([]))["hybrid_kv_cache"] is True
    assert engine_kwargs(parser.parse_args(["--no-hybrid-kv-cache"]))["hybrid_kv_cache"] is False
    assert EngineConfig(**{k: v for k, v in engine_kwargs(parser.parse_args(["--no-hybrid-kv-cache"])).items()
                           if k not in ("seed", "weight_dtype")}).hybrid_kv_cache is False


@pytest.mark.parametrize("sliding_block_size", [4, 2])
def test_a_warm_restart_loads_a_hybrid_prefix_from_the_disk_tier_in_every_group(tiny, tmp_path, sliding_block_size):
    """The tier keeps the pages of both groups (the sliding one's in blocks of its own, carved or
    not); after a restart, a prompt longer than the window is served from it — the full group's
    blocks and the sliding group's window loaded — and decodes as the dense reference does."""
    model, tensors = tiny
    prompt = list(map(int, np.random.default_rng(6).integers(3, CONFIG.vocab_size, 27)))
    config = EngineConfig(num_blocks=64, block_size=4, kv_disk_path=tmp_path / "tier", offload_watermark_blocks=64,
                          sliding_block_size=sliding_block_size)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = Engine(model, ByteTokenizer(), config, weights_digest="0" * 64)
        try:
            tokens = engine.submit(prompt, params).result(timeout=120).outputs[0].token_ids
            runs.append((tokens, engine.stats(), engine.core.disk_tier))
        finally:
            engine.shutdown(timeout=60)
    reference = list(prompt)
    for _ in range(6):
        reference.append(int(np.argmax(dense_logits(CONFIG, tensors, reference)[-1])))
    (cold, cold_stats, _), (warm, warm_stats, opened) = runs
    assert cold == warm == reference[len(prompt):]
    assert opened is not None and opened["recovered"] > 0 and not opened["cleared"]
    assert cold_stats["disk_hit_tokens"] == 0
    # 26 cacheable tokens: 24 in whole blocks of either size, all loaded.
    assert warm_stats["disk_hit_tokens"] == 24 and warm_stats["disk_loads"] > 24 // 4
