"""The forward pass in the core (``pagedkv._core.Decoder``), beyond the numerics the model tests
check against the dense references: bad input is a typed error that touches no K/V, construction
refuses misshapen weights by name, and passes on several threads at once (each joining the one
worker pool) give what they give alone."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from pagedkv._core import Decoder, DecoderLayer, Embedding, Linear
from pagedkv.errors import InvalidArgumentError, ShapeError
from pagedkv.models import CacheStep, LlamaConfig, LlamaModel, LlamaWeights


def single_sequence(tokens: list[int], positions: list[int] | None = None) -> SimpleNamespace:
    n = len(tokens)
    return SimpleNamespace(
        input_ids=np.asarray(tokens, np.int64),
        positions=np.asarray(positions if positions is not None else range(n), np.int64),
        slot_mapping=np.arange(n, dtype=np.int64),
        query_start_loc=np.array([0, n], np.int32),
        context_lens=np.array([n], np.int32),
        block_tables=np.arange(-(-n // 16), dtype=np.int32)[None],
        copy_ops=[],
        logits_indices=np.arange(n, dtype=np.int64),
    )


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel(LlamaWeights.random(LlamaConfig.tiny(), seed=3))


def cache_contents(model: LlamaModel, cache: object, n: int) -> list[np.ndarray]:
    return [part for layer in range(model.config.num_layers) for part in cache.gather(layer, [0], n)]


@pytest.mark.parametrize(
    ("tokens", "positions", "rows", "message"),
    [
        ([1, 2, 512], None, [2], "outside the vocabulary"),
        ([1, 2, 3], [0, 1, 10**6], [2], "past max_position_embeddings"),
        ([1, 2, 3], None, [3], "outside the step"),
    ],
)
def test_bad_input_is_refused_before_any_kv_is_written(model, tokens, positions, rows, message) -> None:
    cache = model.new_kv_cache(4)
    before = cache_contents(model, cache, 3)
    step = CacheStep(single_sequence(tokens, positions), cache)
    with pytest.raises(InvalidArgumentError, match=message):
        model.hidden(step, np.asarray(rows, np.int64))
    assert all(np.array_equal(a, b) for a, b in zip(before, cache_contents(model, cache, 3), strict=True))
    # The same step with good input then runs, and writes.
    good = CacheStep(single_sequence([1, 2, 3]), cache)
    assert model.forward(good).shape == (3, model.config.vocab_size)
    assert not all(np.array_equal(a, b) for a, b in zip(before, cache_contents(model, cache, 3), strict=True))


def test_a_step_of_neither_kind_is_a_type_error(model) -> None:
    with pytest.raises(TypeError, match="SchedulerOutput or a CacheStep"):
        model.forward(single_sequence([1, 2]))  # arrays without a cache


def test_a_misshapen_weight_is_refused_by_name(model) -> None:
    c = model.config
    rng = np.random.default_rng(0)

    def linear(k: int, n: int) -> Linear:
        return Linear(rng.standard_normal((k, n)).astype(np.float32))

    norm = np.ones(c.hidden_size, np.float32)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    good = {"input_norm": norm, "qkv": linear(c.hidden_size, q + 2 * kv), "o": linear(q, c.hidden_size),
            "pre_mlp_norm": norm, "gate_up": linear(c.hidden_size, 2 * c.intermediate_size),
            "down": linear(c.intermediate_size, c.hidden_size)}
    common = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                  num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=1e-5,
                  activation="silu", attention_scale=0.1, embedding_scale=1.0, max_positions=64,
                  rope_frequencies=[np.ones(c.head_dim // 2)],
                  embedding=Embedding(np.zeros((c.vocab_size, c.hidden_size), np.float32)),
                  final_norm=norm, lm_head=linear(c.hidden_size, c.vocab_size))
    assert Decoder(layers=[DecoderLayer(**good)], **common).num_layers == 1
    with pytest.raises(InvalidArgumentError, match=r"layers\[1\]\.down is"):
        Decoder(layers=[DecoderLayer(**good), DecoderLayer(**{**good, "down": linear(3, c.hidden_size)})], **common)
    with pytest.raises(InvalidArgumentError, match=r"layers\[0\]\.k_norm has 3 values"):
        Decoder(layers=[DecoderLayer(**good, k_norm=np.ones(3, np.float32))], **common)
    with pytest.raises(InvalidArgumentError, match=r"layers\[0\]\.rope = 1 names no set"):
        Decoder(layers=[DecoderLayer(**good, rope=1)], **common)
    with pytest.raises(InvalidArgumentError, match="activation must be"):
        Decoder(layers=[DecoderLayer(**good)], **{**common, "activation": "relu"})
    with pytest.raises(InvalidArgumentError, match="the embedding is"):
        Decoder(layers=[DecoderLayer(**good)], **{**common, "embedding": Embedding(np.zeros((3, c.hidden_size), np.float32))})
    with pytest.raises(TypeError, match="must be a DecoderLayer"):
        Decoder(layers=[good], **common)
    with pytest.raises(ShapeError):
        DecoderLayer(**{**good, "input_norm": norm.astype(np.float64)})
    with pytest.raises(InvalidArgumentError, match="rope must be an int"):
        DecoderLayer(**good, rope=-1)
    with pytest.raises(InvalidArgumentError, match="rms_norm_eps must be a finite"):
        Decoder(layers=[DecoderLayer(**good)], **{**common, "rms_norm_eps": float("nan")})


def test_an_embedding_gathers_float_rows_and_refuses_a_float_linear() -> None:
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    embedding = Embedding(table)
    assert embedding.shape == (4, 3) and embedding.nbytes == table.nbytes
    assert np.array_equal(embedding(np.array([3, 0, 3])), table[[3, 0, 3]])
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        embedding(np.array([4]))
    with pytest.raises(InvalidArgumentError, match="quantized weight"):
        Embedding(Linear(table.T.copy()))


def test_passes_on_several_threads_at_once_equal_each_pass_alone(model) -> None:
    prompts = [[int(t) for t in np.random.default_rng(seed).integers(0, 512, 20)] for seed in range(4)]
    alone = [model.forward(CacheStep(single_sequence(p), model.new_kv_cache(2))) for p in prompts]
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for _ in range(5):
                results[i] = model.forward(CacheStep(single_sequence(prompts[i]), model.new_kv_cache(2)))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    for i, want in enumerate(alone):
        assert np.array_equal(results[i], want)
