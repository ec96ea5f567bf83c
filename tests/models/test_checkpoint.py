"""Checkpoint loading against hostile and unusual checkpoints (issue 10, items 11, 23-26): rope
settings in both spellings and their scaling, config fields of the wrong type, configs that would
exhaust memory, unsafe files, and every end-of-sequence id.

Every bad checkpoint is built here in ``tmp_path``: a tiny config saved by ``save_checkpoint`` (the
``safetensors`` package writes the tensors), then one file edited.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from pagedkv import CacheStep, CheckpointError
from pagedkv.loaders import load_checkpoint, load_config, load_tokenizer, save_checkpoint
from pagedkv.models import DenseReference, LlamaConfig, LlamaModel, LlamaWeights
from pagedkv.models.rope import rope_frequencies

TINY = LlamaConfig.tiny().replace(num_layers=1)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    directory = tmp_path / "ckpt"
    save_checkpoint(LlamaWeights.random(TINY, seed=3), directory)
    return directory


def edit_config(directory: Path, **changes: object) -> dict:
    """Rewrites config.json with ``changes`` applied (a value of ``...`` deletes the key)."""
    hf = json.loads((directory / "config.json").read_text())
    hf.update(changes)
    hf = {k: v for k, v in hf.items() if v is not ...}
    (directory / "config.json").write_text(json.dumps(hf))
    return hf


# ---------------------------------------------------------------------------- item 23: rope


def test_rope_theta_written_as_rope_parameters_is_read(checkpoint: Path) -> None:
    # transformers >= 5 keeps theta only inside rope_parameters
    edit_config(checkpoint, rope_theta=..., rope_scaling=..., rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    config = load_checkpoint(checkpoint).config
    assert config.rope_theta == 50000.0 and config.rope_scaling is None


def llama3_by_formula(
    theta: float, head_dim: int, factor: float, low: float, high: float, original: int
) -> tuple[list[float], dict]:
    """Llama 3.1's frequency rescaling, one frequency at a time, and how many fell in each regime."""
    frequencies, regimes = [], {"kept": 0, "divided": 0, "smoothed": 0}
    for i in range(0, head_dim, 2):
        frequency = 1.0 / theta ** (i / head_dim)
        wavelength = 2 * math.pi / frequency
        if wavelength < original / high:
            frequencies.append(frequency)
            regimes["kept"] += 1
        elif wavelength > original / low:
            frequencies.append(frequency / factor)
            regimes["divided"] += 1
        else:
            smooth = (original / wavelength - low) / (high - low)
            frequencies.append((1 - smooth) * frequency / factor + smooth * frequency)
            regimes["smoothed"] += 1
    return frequencies, regimes


LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])
def test_llama3_rope_frequencies_follow_the_formula(checkpoint: Path, spelling: str) -> None:
    # Llama 3.1's head_dim, theta and scaling: every regime of the formula occurs
    rope = {**LLAMA31_ROPE, "rope_theta": 500000.0} if spelling == "rope_parameters" else LLAMA31_ROPE
    edit_config(checkpoint, num_attention_heads=2, num_key_value_heads=2, head_dim=128, rope_theta=500000.0,
                max_position_embeddings=131072, **{"rope_scaling": None, spelling: rope})
    config = load_config(checkpoint)
    want, regimes = llama3_by_formula(500000.0, 128, 8.0, 1.0, 4.0, 8192)
    assert min(regimes.values()) > 0, regimes
    np.testing.assert_allclose(rope_frequencies(config), want, rtol=1e-12)


def test_linear_rope_scaling_divides_every_frequency() -> None:
    config = LlamaConfig.from_hf_dict({**TINY.to_hf_dict(), "rope_scaling": {"type": "linear", "factor": 4.0}})
    plain = [1.0 / 10000.0 ** (i / 32) for i in range(0, 32, 2)]
    np.testing.assert_allclose(rope_frequencies(config), np.array(plain) / 4.0, rtol=1e-12)


def test_llama3_scaled_model_runs_the_scaled_rope(tmp_path: Path) -> None:
    # a short original context so the scaling changes the first positions' angles
    scaling = {**LLAMA31_ROPE, "factor": 4.0, "original_max_position_embeddings": 16}
    config = LlamaConfig.from_hf_dict({**TINY.to_hf_dict(), "rope_scaling": scaling})
    save_checkpoint(LlamaWeights.random(config, seed=4), tmp_path)
    weights = load_checkpoint(tmp_path)
    assert weights.config.rope_scaling is not None and weights.config.rope_scaling.original_max_position_embeddings == 16
    tokens = np.random.default_rng(4).integers(3, 512, 40)
    model = LlamaModel(weights)
    cache = model.new_kv_cache(num_blocks=8, block_size=8)
    logits = model.forward(CacheStep(single_sequence_step(tokens), cache))
    want = DenseReference(weights).logits(tokens)
    assert np.max(np.abs(logits - want)) < 1e-4
    unscaled = DenseReference(LlamaWeights.from_named_tensors(TINY, dict(weights.named_tensors()))).logits(tokens)
    assert np.max(np.abs(unscaled - want)) > 1e-2


class Step:
    """One sequence's whole prefill in blocks 0, 1, ... of a fresh cache."""

    def __init__(self, tokens: np.ndarray, positions: np.ndarray, block_size: int = 8) -> None:
        n = len(tokens)
        self.input_ids = np.asarray(tokens, dtype=np.int64)
        self.positions = np.asarray(positions, dtype=np.int64)
        self.slot_mapping = np.arange(n, dtype=np.int64)
        self.query_start_loc = np.array([0, n], dtype=np.int32)
        self.context_lens = np.array([n], dtype=np.int32)
        self.block_tables = np.arange(-(-n // block_size), dtype=np.int32)[None, :]
        self.copy_ops: list[tuple[int, int]] = []
        self.logits_indices = np.arange(n, dtype=np.int64)


def single_sequence_step(tokens: np.ndarray) -> Step:
    return Step(tokens, np.arange(len(tokens)))


@pytest.mark.parametrize(
    "change, field",
    [
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling: rope_type 'dynamic' is not supported"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0}},
            "rope_parameters: rope_type 'yarn' is not supported",
        ),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}}, "rope_parameters: rope_type 'longrope'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor"),
        (
            {"rope_scaling": {**LLAMA31_ROPE, "low_freq_factor": 4.0}},
            "rope_scaling: llama3 rope needs 0 < low_freq_factor < high_freq_factor",
        ),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "rope_scaling: rope factor"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta_fast": 32}}, "rope_scaling.beta_fast"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "rope_parameters.full_attention"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, "conflicting rope theta"),
        (
            {
                "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                "rope_scaling": {"rope_type": "linear", "factor": 4.0},
            },
            "disagree",
        ),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_rope_settings_this_model_does_not_implement_are_refused(checkpoint: Path, change: dict, field: str) -> None:
    edit_config(checkpoint, **change)
    with pytest.raises(CheckpointError, match=rf"config\.json: .*{re.escape(field)}"):
        load_checkpoint(checkpoint)


# ---------------------------------------------------------------------------- item 24: field types


@pytest.mark.parametrize("change, field", [
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_attention_heads": 0, "head_dim": ...}, "num_attention_heads"),  # head_dim derived: no division by 0
    ({"num_attention_heads": -8}, "num_attention_heads"),
    ({"hidden_size": "256"}, "hidden_size must be an integer, got '256'"),
    ({"vocab_size": ...}, "missing required key vocab_size"),
    ({"vocab_size": None}, "vocab_size must be an integer, got None"),
    ({"rms_norm_eps": None}, "rms_norm_eps must be a number, got None"),
    ({"hidden_act": None}, "hidden_act must be a string, got None"),
    ({"tie_word_embeddings": None}, "tie_word_embeddings must be true or false, got None"),
    ({"intermediate_size": [[768]]}, "intermediate_size must be an integer"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be an integer, got True"),
    ({"num_key_value_heads": 2.0}, "num_key_value_heads must be an integer"),
    ({"head_dim": "32"}, "head_dim must be an integer"),
    ({"max_position_embeddings": 0}, "max_position_embeddings"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
    ({"tie_word_embeddings": 0}, "tie_word_embeddings must be true or false"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps must be a number"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps must be a positive number"),
    ({"rope_theta": [10000]}, "rope_theta must be a number"),
    ({"rope_theta": float("nan")}, "rope_theta must be a positive number"),
    ({"rope_theta": 10**400}, "rope_theta must be a number"),
    ({"bos_token_id": 1.0}, "bos_token_id must be an integer"),
    ({"eos_token_id": [[2]]}, "eos_token_id must be a token id or a list of token ids"),
    ({"eos_token_id": True}, "eos_token_id must be a token id"),
    ({"eos_token_id": 512}, r"special token ids \[1, 512\]"),
    ({"model_type": ["llama"]}, "model_type must be a string"),
    ({"attention_bias": "no"}, "attention_bias must be true or false"),
    ({"rope_scaling": "linear"}, "rope_scaling must be an object"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": "8", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 16}}, "rope_scaling.factor must be a number"),
])
def test_config_fields_of_the_wrong_type_name_the_file_and_field(checkpoint: Path, change: dict, field: str) -> None:
    edit_config(checkpoint, **change)
    with pytest.raises(CheckpointError, match=rf"config\.json: .*{field}") as error:
        load_checkpoint(checkpoint)
    assert error.value.path == str(checkpoint / "config.json")


def test_a_null_where_transformers_gives_null_a_meaning_is_read_as_absent(checkpoint: Path) -> None:
    """Issue 23 item 25: only these nulls are accepted (each derives its value as transformers does)."""
    hf = json.loads((checkpoint / "config.json").read_text())
    hf.update(num_key_value_heads=None, head_dim=None, bos_token_id=None, eos_token_id=None,
              rope_scaling=None, rope_parameters=None)
    config = LlamaConfig.from_hf_dict(hf)
    assert config.num_kv_heads == hf["num_attention_heads"]
    assert config.head_dim == hf["hidden_size"] // hf["num_attention_heads"]
    assert config.bos_token_id is None and config.eos_token_ids == () and config.rope_scaling is None


@pytest.mark.parametrize("content, message", [
    (b'{"vocab_size": "\xff\xfe"}', "not UTF-8 text"),
    (b"[" * 100_000 + b"]" * 100_000, "malformed JSON: nested too deeply"),
    (b'{"vocab_size": 1' + b"0" * 5000 + b"}", "malformed JSON"),
    (b"[512]", "expected a JSON object"),
])
def test_config_json_that_is_not_a_json_object_names_the_file(checkpoint: Path, content: bytes, message: str) -> None:
    (checkpoint / "config.json").write_bytes(content)
    with pytest.raises(CheckpointError, match=rf"config\.json: {message}"):
        load_checkpoint(checkpoint)


def test_tie_word_embeddings_false_as_a_bool_loads_untied(checkpoint: Path) -> None:
    edit_config(checkpoint, tie_word_embeddings=False)
    weights = load_checkpoint(checkpoint)
    assert not weights.config.tie_word_embeddings and weights.lm_head is not weights.embed_tokens


# ---------------------------------------------------------------------------- item 25: resources


def test_a_config_claiming_a_million_layers_fails_fast_before_allocating(checkpoint: Path) -> None:
    edit_config(checkpoint, num_hidden_layers=10**6)
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(
            CheckpointError, match=r"tensors missing .*model\.layers\.1\.input_layernorm\.weight.* and 8999988 more"
        ):
            load_checkpoint(checkpoint)
        elapsed = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 1.0, f"took {elapsed:.2f} s"
    assert peak < 4 << 20, f"peak {peak / 2**20:.1f} MiB"  # the weights of the one real layer are never read


def test_header_claiming_more_bytes_than_the_file_holds_is_refused_before_reading(checkpoint: Path) -> None:
    path = checkpoint / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes((2**62).to_bytes(8, "little") + data[8:])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a valid safetensors file: header length"):
        load_checkpoint(checkpoint)


def test_tensor_extending_past_the_end_of_the_file_is_refused(checkpoint: Path) -> None:
    path = checkpoint / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a valid safetensors file: tensor .* malformed"):
        load_checkpoint(checkpoint)


def test_rotary_angles_are_not_tabled_for_max_position_embeddings() -> None:
    weights = LlamaWeights.random(TINY.replace(max_position_embeddings=2**20), seed=5)
    tracemalloc.start()
    try:
        model = LlamaModel(weights)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"peak {peak / 2**20:.1f} MiB"  # the fused weights are ~3 MiB
    # the last position still runs, its angles computed on the fly
    cache = model.new_kv_cache(num_blocks=1, block_size=8)
    logits = model.forward(CacheStep(Step(np.array([5]), np.array([2**20 - 1])), cache))
    assert logits.shape == (1, 512) and np.isfinite(logits).all()


# ---------------------------------------------------------------------------- item 26: unsafe files


def make_sharded(tmp_path: Path) -> tuple[Path, dict]:
    directory = tmp_path / "ckpt"
    save_checkpoint(LlamaWeights.random(TINY, seed=6), directory, max_shard_bytes=1_000_000)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return directory, index


def rename_shard_in_index(directory: Path, index: dict, old: str, new: str) -> None:
    index["weight_map"] = {k: (new if v == old else v) for k, v in index["weight_map"].items()}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("entry", ["../outside.safetensors", "ABSOLUTE", "sub/../../outside.safetensors"])
def test_index_entries_outside_the_checkpoint_directory_are_refused(tmp_path: Path, entry: str) -> None:
    directory, index = make_sharded(tmp_path)
    shard = min(index["weight_map"].values())
    os.replace(directory / shard, tmp_path / "outside.safetensors")  # a valid shard: main would load it
    entry = str(tmp_path / "outside.safetensors") if entry == "ABSOLUTE" else entry
    rename_shard_in_index(directory, index, shard, entry)
    with pytest.raises(CheckpointError, match=r"refused: .*named by model\.safetensors\.index\.json") as error:
        load_checkpoint(directory)
    assert error.value.path == str(directory / entry)


def test_symlinks_escaping_the_checkpoint_directory_are_refused(checkpoint: Path) -> None:
    outside = checkpoint.parent / "elsewhere.safetensors"
    os.replace(checkpoint / "model.safetensors", outside)
    (checkpoint / "model.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: refused: resolves to .* outside the checkpoint directory"):
        load_checkpoint(checkpoint)


def test_a_symlink_loop_is_refused(checkpoint: Path) -> None:
    (checkpoint / "model.safetensors").unlink()
    (checkpoint / "model.safetensors").symlink_to("model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot resolve"):
        load_checkpoint(checkpoint)


def test_symlinks_inside_the_checkpoint_directory_are_followed(checkpoint: Path) -> None:
    (checkpoint / "blobs").mkdir()
    os.replace(checkpoint / "model.safetensors", checkpoint / "blobs" / "0123abcd")
    (checkpoint / "model.safetensors").symlink_to(Path("blobs") / "0123abcd")
    assert load_checkpoint(checkpoint).config == TINY


def load_in_thread(function: object, *args: object) -> BaseException | None:
    """Runs ``function(*args)`` on a daemon thread; fails the test if it blocks for 10 s."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            function(*args)  # type: ignore[operator]
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "loading blocked on a file that is not a regular file"
    return outcome[0]


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "generation_config.json"])
def test_a_fifo_in_place_of_a_checkpoint_file_is_refused_without_blocking(checkpoint: Path, name: str) -> None:
    (checkpoint / name).unlink(missing_ok=True)
    os.mkfifo(checkpoint / name)
    error = load_in_thread(load_checkpoint, checkpoint)
    assert isinstance(error, CheckpointError) and f"{name}: refused: not a regular file" in str(error), error


def test_a_fifo_named_as_a_shard_is_refused_without_blocking(tmp_path: Path) -> None:
    directory, index = make_sharded(tmp_path)
    shard = max(index["weight_map"].values())
    (directory / shard).unlink()
    os.mkfifo(directory / shard)
    error = load_in_thread(load_checkpoint, directory)
    assert isinstance(error, CheckpointError) and f"{shard}: refused: not a regular file" in str(error), error


def test_a_fifo_named_tokenizer_json_is_refused_without_blocking(checkpoint: Path) -> None:
    os.mkfifo(checkpoint / "tokenizer.json")
    error = load_in_thread(load_tokenizer, checkpoint, 512)
    assert isinstance(error, CheckpointError) and "tokenizer.json: refused: not a regular file" in str(error), error


def test_a_directory_named_like_a_shard_is_refused(checkpoint: Path) -> None:
    (checkpoint / "extra.safetensors").mkdir()
    with pytest.raises(CheckpointError, match=r"extra\.safetensors: refused: not a regular file"):
        load_checkpoint(checkpoint)


# ---------------------------------------------------------------------------- item 11: every EOS id


@pytest.mark.parametrize("config_eos, generation_eos, want", [
    ([2, 465], None, (2, 465)),
    (2, [465, 2, 7], (2, 465, 7)),
    ([2, 465], 7, (2, 465, 7)),
    (None, [465], (465,)),
    (2, "ABSENT", (2,)),
])
def test_every_eos_id_of_config_and_generation_config_is_kept(
    checkpoint: Path, config_eos: object, generation_eos: object, want: tuple[int, ...]
) -> None:
    edit_config(checkpoint, eos_token_id=config_eos)
    if generation_eos != "ABSENT":
        (checkpoint / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": generation_eos}))
    assert load_checkpoint(checkpoint).config.eos_token_ids == want


@pytest.mark.parametrize("generation, message", [
    ({"eos_token_id": "2"}, "eos_token_id must be a token id or a list of token ids"),
    ({"eos_token_id": [600]}, r"special token ids \[1, 2, 600\]"),
    ([2], "expected a JSON object"),
])
def test_a_bad_generation_config_names_that_file(checkpoint: Path, generation: object, message: str) -> None:
    (checkpoint / "generation_config.json").write_text(json.dumps(generation))
    with pytest.raises(CheckpointError, match=rf"generation_config\.json: .*{message}"):
        load_checkpoint(checkpoint)
