"""The model half of pagedkv: paged forward vs the dense reference, checkpoints, sampling,
tokenizers, the simulated model.

Steps are built here from a BlockManager (no scheduler): each work item ``(seq_id, tokens, start,
end)`` runs ``tokens[start:end]`` of a sequence whose slots were allocated or appended before.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

import pagedkv
from pagedkv import BlockManager, CacheStep, CheckpointError, InvalidArgumentError
from pagedkv._core import default_isas
from pagedkv.loaders import load_checkpoint, load_tokenizer, save_checkpoint
from pagedkv.models import DenseReference, LlamaConfig, LlamaModel, LlamaWeights, SimulatedModel, StepCostModel
from pagedkv.sampling import SamplingParams, sample
from pagedkv.text import ByteTokenizer, HFTokenizer


@pytest.fixture(autouse=True, scope="module")
def single_threaded_blas() -> object:
    """The dense reference's matrices are small and the machine's 2 cores are shared: spinning
    BLAS threads would only slow the tests down."""
    with threadpool_limits(limits=1, user_api="blas"):
        yield


TOLERANCE = 1e-4  # max abs logit difference, float32 paged forward vs float64 reference
# Where bfloat16 weights multiply a prompt's rows on bf16 pairs (AVX512-BF16: the activations
# rounded to bf16, as PyTorch's bfloat16 does), what that rounding adds: measured 1.2e-2.
PAIRED_TOLERANCE = 3e-2
BLOCK_SIZE = 8


@dataclass
class Step:
    """A ModelStep built by hand."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    copy_ops: list[tuple[int, int]]
    logits_indices: np.ndarray


Work = tuple[int, Sequence[int], int, int]  # (seq_id, all tokens, start, end)


def build_step(manager: BlockManager, work: Sequence[Work], copy_ops: Sequence[tuple[int, int]] = ()) -> Step:
    """The step running ``tokens[start:end]`` of each work item; logits wanted for every row."""
    tables = manager.block_tables([seq for seq, *_ in work])
    ids: list[int] = []
    positions, slots, starts = [], [], [0]
    for row, (_, tokens, start, end) in enumerate(work):
        pos = np.arange(start, end, dtype=np.int64)
        ids.extend(tokens[start:end])
        positions.append(pos)
        slots.append(tables[row][pos // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE + pos % BLOCK_SIZE)
        starts.append(starts[-1] + end - start)
    return Step(
        input_ids=np.array(ids, dtype=np.int64),
        positions=np.concatenate(positions),
        slot_mapping=np.concatenate(slots),
        query_start_loc=np.array(starts, dtype=np.int32),
        context_lens=np.array([end for *_, end in work], dtype=np.int32),
        block_tables=tables,
        copy_ops=list(copy_ops),
        logits_indices=np.arange(starts[-1], dtype=np.int64),
    )


class Harness:
    """The tiny model on a paged cache, with the dense reference to check every step against."""

    def __init__(
        self,
        num_blocks: int = 64,
        enable_prefix_caching: bool = True,
        weight_dtype: str = "float32",
        rounding_dir: Path | None = None,
    ) -> None:
        self.weights = LlamaWeights.random(LlamaConfig.tiny(), seed=0)
        self.model = LlamaModel(self.weights, weight_dtype=weight_dtype)
        stored = self.weights if rounding_dir is None else stored_projections(self.weights, weight_dtype, rounding_dir)
        self.reference = DenseReference(stored)
        self.manager = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching)
        self.cache = self.model.new_kv_cache(num_blocks, BLOCK_SIZE)
        paired = weight_dtype == "bfloat16" and dict(default_isas())["ceiling"] == "avx512bf16"
        self.tolerance = PAIRED_TOLERANCE if paired else TOLERANCE

    def run(self, work: Sequence[Work], copy_ops: Sequence[tuple[int, int]] = ()) -> list[np.ndarray]:
        """Runs one step; checks every row against the reference; returns each item's logits."""
        step = build_step(self.manager, work, copy_ops)
        logits = self.model.forward(CacheStep(step, self.cache))
        assert logits.dtype == np.float32 and logits.shape == (len(step.input_ids), self.model.config.vocab_size)
        per_item = np.split(logits, step.query_start_loc[1:-1])
        for (seq, tokens, start, end), got in zip(work, per_item, strict=True):
            want = self.reference.logits(tokens[:end])[start:end]
            error = np.max(np.abs(got - want))
            assert error < self.tolerance, f"seq {seq} rows {start}:{end}: max abs error {error:.2e}"
        return per_item


def stored_projections(weights: LlamaWeights, dtype: str, directory: Path) -> LlamaWeights:
    """``weights`` with every matrix rounded to ``dtype`` as a checkpoint stores it (to nearest
    even), the embedding table kept float32: what ``LlamaModel(weights, weight_dtype=dtype)``
    multiplies by. (The norms are ones, exact in every dtype.)"""
    save_checkpoint(weights, directory, dtype=dtype)
    return dataclasses.replace(load_checkpoint(directory), embed_tokens=weights.embed_tokens)


def random_tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, LlamaConfig.tiny().vocab_size, n).tolist()


# ---------------------------------------------------------------------------- paged forward


@pytest.mark.parametrize("weight_dtype", ["float32", "float16", "bfloat16"])
def test_mixed_length_batch_prefill_then_decode_matches_reference(weight_dtype: str, tmp_path: Path) -> None:
    """16-bit weights are compared with the reference over the same rounded weights, so the
    float32 tolerance still holds: the model adds no error beyond float32 sums. (Against the
    unrounded weights, bfloat16's 2⁻⁹ relative rounding moves these logits by ~1e-2.) On bf16
    pairs a bfloat16 prompt rounds the activations too, and its K/V carry that into decode."""
    rounding_dir = None if weight_dtype == "float32" else tmp_path
    h, rng = Harness(weight_dtype=weight_dtype, rounding_dir=rounding_dir), np.random.default_rng(1)
    assert h.model.weight_dtype == weight_dtype
    prompts = {seq: random_tokens(rng, n) for seq, n in enumerate([1, 7, 8, 19, 33])}
    for seq, tokens in prompts.items():
        assert h.manager.allocate(seq, tokens) == 0
    logits = h.run([(seq, tokens, 0, len(tokens)) for seq, tokens in prompts.items()])
    for _ in range(3):
        work = []
        for (seq, tokens), rows in zip(prompts.items(), logits, strict=True):
            tokens.append(int(np.argmax(rows[-1])))
            assert h.manager.append(seq, [tokens[-1]]) is None
            work.append((seq, tokens, len(tokens) - 1, len(tokens)))
        logits = h.run(work)


def test_half_precision_weights_are_rounded_not_kept_in_float32() -> None:
    """The reference over unrounded weights is off by more than the tolerance: the comparison in
    the test above can fail."""
    h = Harness(weight_dtype="bfloat16")
    h.tolerance = TOLERANCE  # 9 rows: f32 tiles on every CPU (bf16 pairs start at 16)
    assert h.manager.allocate(0, list(range(3, 12))) == 0
    with pytest.raises(AssertionError, match="max abs error"):
        h.run([(0, list(range(3, 12)), 0, 9)])


def test_chunked_prefill_gives_the_same_logits_as_one_pass() -> None:
    h, rng = Harness(enable_prefix_caching=False), np.random.default_rng(2)
    prompt, other = random_tokens(rng, 45), random_tokens(rng, 10)
    h.manager.allocate(0, prompt)
    whole = h.run([(0, prompt, 0, 45)])[0]
    # sequence 1 prefills the same prompt in three chunks while sequence 2 decodes beside it
    h.manager.allocate(2, other)
    h.run([(2, other, 0, len(other))])
    assert h.manager.allocate(1, prompt) == 0
    chunks = []
    for start, end in [(0, 13), (13, 30), (30, 45)]:
        other.append(7 + start)
        h.manager.append(2, [other[-1]])
        rows = h.run([(2, other, len(other) - 1, len(other)), (1, prompt, start, end)])
        chunks.append(rows[1])
    assert np.max(np.abs(np.concatenate(chunks) - whole)) < TOLERANCE


def test_prefix_blocks_served_from_cache_are_not_recomputed() -> None:
    h, rng = Harness(), np.random.default_rng(3)
    first = random_tokens(rng, 40)
    h.manager.allocate(0, first)
    h.run([(0, first, 0, 40)])
    # a live sequence shares 3 full blocks: only the new tail is computed
    second = first[:24] + random_tokens(rng, 10)
    assert h.manager.allocate(1, second) == 24
    assert (h.manager.block_table(1)[:3] == h.manager.block_table(0)[:3]).all()
    h.run([(1, second, 24, len(second))])
    # after the first sequence ends its blocks stay cached and a third request revives 4 of them
    h.manager.free(0)
    third = first[:35] + random_tokens(rng, 3)
    assert h.manager.allocate(2, third) == 32
    h.run([(2, third, 32, len(third))])


def test_forked_sequences_copy_the_shared_block_before_writing() -> None:
    h, rng = Harness(), np.random.default_rng(4)
    prompt = random_tokens(rng, 20)  # 2.5 blocks: the tail block is partial
    h.manager.allocate(0, prompt)
    h.run([(0, prompt, 0, 20)])
    h.manager.fork(0, 1)
    parent, child = prompt + [11], prompt + [12]
    copy = h.manager.append(0, [11])
    assert copy is not None and h.manager.append(1, [12]) is None
    h.run([(0, parent, 20, 21), (1, child, 20, 21)], copy_ops=[copy])


def test_greedy_generation_through_the_paged_model_matches_the_reference() -> None:
    h, rng = Harness(), np.random.default_rng(5)
    prompts = [random_tokens(rng, n) for n in (3, 12, 17)]
    sequences = [list(p) for p in prompts]
    for seq, tokens in enumerate(sequences):
        h.manager.allocate(seq, tokens)
    step = build_step(h.manager, [(seq, t, 0, len(t)) for seq, t in enumerate(sequences)])
    step.logits_indices = step.query_start_loc[1:].astype(np.int64) - 1
    for _ in range(6):
        logits = h.model.forward(CacheStep(step, h.cache))
        for seq, tokens in enumerate(sequences):
            tokens.append(int(np.argmax(logits[seq])))
            h.manager.append(seq, [tokens[-1]])
        step = build_step(h.manager, [(seq, t, len(t) - 1, len(t)) for seq, t in enumerate(sequences)])
    for prompt, tokens in zip(prompts, sequences, strict=True):
        assert tokens[len(prompt):] == h.reference.generate_greedy(prompt, 6)


def test_forward_reads_only_the_requested_logit_rows() -> None:
    h = Harness()
    tokens = random_tokens(np.random.default_rng(6), 10)
    h.manager.allocate(0, tokens)
    step = build_step(h.manager, [(0, tokens, 0, 10)])
    step.logits_indices = np.array([9, 4], dtype=np.int64)
    logits = h.model.forward(CacheStep(step, h.cache))
    want = h.reference.logits(tokens)[[9, 4]]
    assert logits.shape == (2, 512) and np.max(np.abs(logits - want)) < TOLERANCE


# ---------------------------------------------------------------------------- config


SMOLLM_LIKE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "hidden_act": "silu", "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": [2, 0], "rope_scaling": None,
}


def test_config_reads_hugging_face_keys() -> None:
    config = LlamaConfig.from_hf_dict(SMOLLM_LIKE)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (30, 9, 3, 64)
    assert config.tie_word_embeddings and config.eos_token_ids == (2, 0)
    assert LlamaConfig.from_hf_dict(config.to_hf_dict()) == config


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling"),
    ({"num_key_value_heads": 4}, "multiple"),
    ({"model_type": "gpt2"}, "model_type"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_config_rejects_what_the_model_does_not_implement(change: dict, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        LlamaConfig.from_hf_dict({**SMOLLM_LIKE, **change})


# ---------------------------------------------------------------------------- checkpoints


def assert_same_weights(a: LlamaWeights, b: LlamaWeights) -> None:
    assert a.config == b.config
    named_a, named_b = dict(a.named_tensors()), dict(b.named_tensors())
    assert named_a.keys() == named_b.keys()
    for name in named_a:
        assert named_b[name].dtype == np.float32
        np.testing.assert_array_equal(named_a[name], named_b[name], err_msg=name)


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    weights = LlamaWeights.random(LlamaConfig.tiny(), seed=7)
    save_checkpoint(weights, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert_same_weights(weights, load_checkpoint(tmp_path))


def test_sharded_checkpoint_round_trip_with_tied_embeddings(tmp_path: Path) -> None:
    weights = LlamaWeights.random(LlamaConfig.tiny().replace(tie_word_embeddings=True), seed=8)
    save_checkpoint(weights, tmp_path, max_shard_bytes=2_000_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and "lm_head.weight" not in index["weight_map"]
    loaded = load_checkpoint(tmp_path)
    assert_same_weights(weights, loaded)
    assert loaded.lm_head is loaded.embed_tokens


def test_half_precision_checkpoints_load_as_float32(tmp_path: Path) -> None:
    weights = LlamaWeights.random(LlamaConfig.tiny(), seed=9)
    save_checkpoint(weights, tmp_path / "f16", dtype="float16")
    save_checkpoint(weights, tmp_path / "bf16", dtype="bfloat16")
    f16, bf16 = load_checkpoint(tmp_path / "f16"), load_checkpoint(tmp_path / "bf16")
    for (name, original), (_, half), (_, brain) in zip(
        weights.named_tensors(), f16.named_tensors(), bf16.named_tensors(), strict=True
    ):
        np.testing.assert_array_equal(half, original.astype(np.float16).astype(np.float32), err_msg=name)
        assert not (brain.view(np.uint32) & 0xFFFF).any(), name  # representable in bfloat16
        assert np.all(np.abs(brain - original) <= np.abs(original) * 2.0 ** -8), name  # rounded to nearest


def test_loaded_checkpoint_runs_the_same_forward(tmp_path: Path) -> None:
    weights = LlamaWeights.random(LlamaConfig.tiny(), seed=10)
    save_checkpoint(weights, tmp_path)
    tokens = random_tokens(np.random.default_rng(10), 9)
    np.testing.assert_array_equal(
        DenseReference(load_checkpoint(tmp_path)).logits(tokens), DenseReference(weights).logits(tokens)
    )


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    save_checkpoint(LlamaWeights.random(LlamaConfig.tiny().replace(num_layers=1), seed=11), tmp_path)
    return tmp_path


def test_missing_config_names_the_file(checkpoint: Path) -> None:
    (checkpoint / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: file not found") as error:
        load_checkpoint(checkpoint)
    assert error.value.path == str(checkpoint / "config.json")


def test_malformed_config_names_the_file(checkpoint: Path) -> None:
    (checkpoint / "config.json").write_text('{"vocab_size": 512,')
    with pytest.raises(CheckpointError, match=r"config\.json: malformed JSON"):
        load_checkpoint(checkpoint)


def test_unsupported_config_names_the_file(checkpoint: Path) -> None:
    hf = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**hf, "rope_scaling": {"type": "dynamic", "factor": 2.0}}))
    with pytest.raises(CheckpointError, match=r"config\.json: .*rope_scaling"):
        load_checkpoint(checkpoint)


def test_missing_safetensors_names_the_directory(checkpoint: Path) -> None:
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors file") as error:
        load_checkpoint(checkpoint)
    assert error.value.path == str(checkpoint)


def test_wrong_tensor_shape_names_the_file_and_tensor(checkpoint: Path) -> None:
    hf = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**hf, "intermediate_size": 512}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor model\.layers\.0\.mlp\.\w+_proj\.weight has shape"):
        load_checkpoint(checkpoint)


def test_missing_tensor_is_named(checkpoint: Path) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(checkpoint / "model.safetensors")
    del tensors["model.layers.0.self_attn.v_proj.weight"]
    save_file(tensors, checkpoint / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing .*model\.layers\.0\.self_attn\.v_proj\.weight"):
        load_checkpoint(checkpoint)


def test_corrupt_safetensors_names_the_file(checkpoint: Path) -> None:
    (checkpoint / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a valid safetensors file"):
        load_checkpoint(checkpoint)


def test_index_naming_a_missing_shard_names_the_shard(tmp_path: Path) -> None:
    save_checkpoint(LlamaWeights.random(LlamaConfig.tiny(), seed=12), tmp_path, max_shard_bytes=2_000_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    second_shard = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / second_shard).unlink()
    with pytest.raises(CheckpointError, match=rf"{second_shard}: file not found"):
        load_checkpoint(tmp_path)


# ---------------------------------------------------------------------------- sampling


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def draw_many(logits: np.ndarray, params: SamplingParams, count: int) -> np.ndarray:
    """``count`` draws of one row under ``params`` (one batched call sharing one generator)."""
    return sample(np.tile(logits, (count, 1)), [params] * count, [np.random.default_rng(99)] * count)


def test_greedy_rows_take_the_argmax_beside_sampled_rows() -> None:
    logits = np.random.default_rng(13).standard_normal((6, 50)).astype(np.float32)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1)] * 3
    tokens = sample(logits, params, [p.make_generator() for p in params])
    assert tokens.dtype == np.int64
    np.testing.assert_array_equal(tokens[::2], np.argmax(logits[::2], axis=1))


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch() -> None:
    rng = np.random.default_rng(14)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=42)

    def run(batch_rows: int, params: SamplingParams) -> list[int]:
        generator = params.make_generator()
        out: list[int] = []
        for _ in range(40):
            logits = rng_logits[len(out)]
            others = rng.standard_normal((batch_rows, 64))
            batch = np.vstack([logits, others])
            others_params = [SamplingParams(temperature=1.0)] * batch_rows
            tokens = sample(batch, [params, *others_params], [generator, *(p.make_generator() for p in others_params)])
            out.append(int(tokens[0]))
        return out

    rng_logits = rng.standard_normal((40, 64))
    alone, batched = run(0, seeded), run(5, seeded)
    assert alone == batched
    assert run(0, SamplingParams(temperature=0.8, top_p=0.9, seed=43)) != alone


def test_samples_follow_the_tempered_softmax() -> None:
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0])
    for temperature in (1.0, 0.5):
        draws = draw_many(logits, SamplingParams(temperature=temperature), 20000)
        frequencies = np.bincount(draws, minlength=5) / len(draws)
        assert np.max(np.abs(frequencies - softmax(logits / temperature))) < 0.015


def test_top_k_restricts_the_support() -> None:
    logits = np.random.default_rng(15).standard_normal(100)
    top3 = set(np.argsort(-logits)[:3].tolist())
    assert set(draw_many(logits, SamplingParams(top_k=3, temperature=2.0), 3000).tolist()) == top3
    assert set(draw_many(logits, SamplingParams(top_k=1), 200).tolist()) == {int(np.argmax(logits))}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = np.log(np.array([0.15, 0.5, 0.05, 0.3]))
    assert set(draw_many(logits, SamplingParams(top_p=0.75), 3000).tolist()) == {1, 3}
    assert set(draw_many(logits, SamplingParams(top_p=0.4), 300).tolist()) == {1}
    kept = draw_many(logits, SamplingParams(top_p=0.9), 20000)
    frequencies = np.bincount(kept, minlength=4) / len(kept)  # renormalised over {1, 3, 0}
    np.testing.assert_allclose(frequencies, [0.15 / 0.95, 0.5 / 0.95, 0.0, 0.3 / 0.95], atol=0.015)


# max_tokens, n and stop_token_ids are the scheduler's to check (tests/engine/test_engine_submit.py).
@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"temperature": float("nan")}, {"top_k": -1},
    {"top_p": 0.0}, {"top_p": 1.5}, {"seed": -1},
])
def test_sampling_params_reject_invalid_values(kwargs: dict) -> None:
    with pytest.raises(InvalidArgumentError):
        SamplingParams(**kwargs)


# ---------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trips_utf8_within_the_tiny_vocabulary() -> None:
    tokenizer = load_tokenizer(None, LlamaConfig.tiny().vocab_size)
    assert isinstance(tokenizer, ByteTokenizer)
    text = "Once upon a time, naïve café 世界 🚀"
    ids = tokenizer.encode(text)
    assert ids[0] == ByteTokenizer.BOS_ID and max(ids) < LlamaConfig.tiny().vocab_size
    assert tokenizer.decode(ids + [ByteTokenizer.EOS_ID]) == text


def test_tokenizer_json_in_the_checkpoint_is_used(tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    hf = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1, "paged": 2, "world": 3}, unk_token="[UNK]"))
    hf.pre_tokenizer = Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_tokenizer(tmp_path, vocab_size=512)
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.encode("hello paged world") == [1, 2, 3]
    assert tokenizer.decode([3, 1]) == "world hello"
    with pytest.raises(InvalidArgumentError, match="tokenizer.json"):
        load_tokenizer(tmp_path, vocab_size=3)


def test_unreadable_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path, vocab_size=512)


# ---------------------------------------------------------------------------- simulated model


def simulated_step(positions: list[int], input_ids: list[int], context_lens: list[int]) -> Step:
    n = len(positions)
    return Step(
        input_ids=np.array(input_ids), positions=np.array(positions, dtype=np.int64),
        slot_mapping=np.zeros(n, dtype=np.int64), query_start_loc=np.arange(n + 1, dtype=np.int32),
        context_lens=np.array(context_lens, dtype=np.int32), block_tables=np.zeros((n, 1), dtype=np.int32),
        copy_ops=[], logits_indices=np.arange(n),
    )


def test_simulated_step_time_follows_the_cost_model() -> None:
    model = SimulatedModel(cost=StepCostModel(fixed=0.01, per_token=0.001, per_context_token=1e-6))
    step = simulated_step([99, 499], [5, 6], [100, 500])
    assert model.step_seconds(step) == pytest.approx(0.01 + 0.001 * 2 + 1e-6 * 600)
    default = SimulatedModel().step_seconds(simulated_step([0] * 32, [5] * 32, [1000] * 32))
    assert 0.005 < default < 0.05  # a batch-32 decode step of a 7B model takes milliseconds


def test_simulated_tokens_are_deterministic_and_avoid_stop_tokens() -> None:
    model = SimulatedModel(vocab_size=1000, stop_token_ids=(2,), seed=3)
    positions = list(range(5000))
    tokens = model.sample(simulated_step(positions, [7] * 5000, [p + 1 for p in positions]))
    assert tokens.min() >= 3 and tokens.max() < 1000 and 2 not in tokens
    assert len(np.unique(tokens)) > 900  # spread over the vocabulary
    alone = model.sample(simulated_step([1234], [7], [1235]))
    assert alone[0] == tokens[1234]  # a row's token does not depend on its batch
    assert (SimulatedModel(vocab_size=1000, seed=4).sample(simulated_step(positions, [7] * 5000, positions)) != tokens).any()
    stopping = SimulatedModel(vocab_size=1000, stop_token_ids=(2,), stop_probability=0.25)
    stops = np.mean(stopping.sample(simulated_step(positions, [7] * 5000, positions)) == 2)
    assert 0.2 < stops < 0.3


def test_public_names_are_reexported() -> None:
    assert pagedkv.LlamaConfig is LlamaConfig and pagedkv.SamplingParams is SamplingParams
    assert pagedkv.SimulatedModel is SimulatedModel and pagedkv.CheckpointError is CheckpointError
