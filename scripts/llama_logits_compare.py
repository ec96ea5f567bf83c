"""`make parity-llama`: pagedkv's teacher-forced logits against llama.cpp's on the same GGUF file.

For each registry model (SmolLM2-135M's Q4_1 file, Gemma 3 270M's Q4_K_M file) a few sequences
are taken from the golden files of tests/data (a prompt followed by the tokens transformers
generated from it, BOS included where the tokenizer adds it; cut at ``--max-tokens``), and every
position of each is scored by

- pagedkv with ``weight_dtype="auto"``: the file's quantized weights, activations rounded to int8
  per 32 values as llama.cpp's Q8 dot products do. That int8 path runs below 64 rows per product
  (decode steps, short prompts); from 64 rows the core dequantizes the weight into f32 panels, so
  a whole prefill of 64+ tokens is the float32 model's product. Hence two runs: ``pagedkv_auto``,
  each sequence prefilled whole (as tests/support/prefill.py does), and ``pagedkv_auto_chunked``,
  prefilled in chunks of ``--chunk`` (32) tokens on one cache, so every position takes the int8
  path, as decode does;
- pagedkv with ``weight_dtype="float32"``: the same file dequantized (for scale);
- llama.cpp through scripts/llama_logits.cpp (``--tool``), once as it runs by default (f16 K/V
  cache, flash attention "auto", which is on for the CPU) and once with an f32 K/V cache and
  flash attention off, to separate the weights' arithmetic from the attention's;
- and, as a check of the harness, llama.cpp on the file requantized to F32 (``llama-quantize
  --allow-requantize``, in a temporary directory) with the f32 attention, against pagedkv float32:
  the same weights in float arithmetic, which should agree to float rounding (and ggml's f16 GELU
  table for Gemma 3).

Each sequence is prefilled whole on a fresh cache (one llama_decode, one pagedkv forward), both
with ``--threads`` threads. For each pair the report gives max |Δlogit|, RMS Δlogit, the share
of positions with the same top token, and that share where the reference's top two logits are
more than 0.5 apart. Writes JSON to ``--out`` and prints a summary.

How to read it: with activations rounded to int8 per 32 values, any perturbation upstream (f16
instead of f32 K/V, another order of additions) moves values across rounding boundaries in every
later layer, so two implementations that are not bit-identical differ by about the quantization
noise itself. The floor for pagedkv auto vs llama.cpp is therefore llama.cpp against itself
under its two attention configurations (``llama_default vs llama_f32_attention``), not zero.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import pagedkv  # noqa: E402
from pagedkv.loaders.registry import load_model, locate_registered  # noqa: E402
from pagedkv.models import CacheStep  # noqa: E402
from support.prefill import prefill_logits  # noqa: E402

MARGIN = 0.5
# Golden prompts per model: short text, a chat turn, and the start of the long prompt.
MODELS = {
    "smollm2-135m": ("smollm2_golden.json", ["text_capital", "text_story", "text_code", "chat_haiku", "chat_long_summary"]),
    "gemma3-270m": ("gemma3_golden.json", ["text_capital", "text_story", "text_code", "text_colors", "text_long_logbook"]),
}
# The llama.cpp configurations: its defaults, and the attention in f32 throughout.
LLAMA_CONFIGS = {
    "default": ["--kv", "f16", "--flash-attn", "auto"],
    "f32_attention": ["--kv", "f32", "--flash-attn", "off"],
}
# (candidate, reference) pairs reported; the top-1 margin is the reference's.
PAIRS = [
    ("pagedkv_auto_chunked", "llama_default"),
    ("pagedkv_auto_chunked", "llama_f32_attention"),
    ("pagedkv_auto_chunked", "pagedkv_float32"),
    ("pagedkv_auto", "llama_default"),
    ("pagedkv_auto", "llama_f32_attention"),
    ("pagedkv_float32", "llama_default"),
    ("pagedkv_auto", "pagedkv_float32"),
    ("llama_default", "llama_f32_attention"),
    ("pagedkv_float32", "llama_f32_file"),
    ("pagedkv_float32_chunked", "pagedkv_float32"),
]
# The RMS and max per sequence, for these.
PER_SEQUENCE_PAIRS = [
    ("pagedkv_auto_chunked", "llama_default"),
    ("pagedkv_auto", "llama_default"),
    ("pagedkv_auto_chunked", "pagedkv_float32"),
    ("pagedkv_auto", "pagedkv_float32"),
    ("llama_default", "pagedkv_float32"),
]


class Tally:
    """Running figures of candidate - reference logits over many rows."""

    def __init__(self) -> None:
        self.max_abs = 0.0
        self.sum_sq = 0.0
        self.values = 0
        self.rows = 0
        self.agree = 0
        self.clear = 0
        self.clear_agree = 0
        self.worst: dict | None = None

    def add(self, sequence: str, candidate: np.ndarray, reference: np.ndarray) -> None:
        difference = candidate.astype(np.float64) - reference.astype(np.float64)
        row_max = np.abs(difference).max(axis=1)
        if row_max.max() > self.max_abs:
            self.max_abs = float(row_max.max())
            self.worst = {"sequence": sequence, "position": int(row_max.argmax())}
        self.sum_sq += float(np.sum(difference**2))
        self.values += difference.size
        top_two = np.partition(reference, -2, axis=1)[:, -2:]
        clear = top_two[:, 1] - top_two[:, 0] > MARGIN
        same = candidate.argmax(axis=1) == reference.argmax(axis=1)
        self.rows += len(same)
        self.agree += int(same.sum())
        self.clear += int(clear.sum())
        self.clear_agree += int(same[clear].sum())

    def report(self) -> dict:
        return {
            "max_abs_diff": round(self.max_abs, 4),
            "rms_diff": round(float(np.sqrt(self.sum_sq / self.values)), 4),
            "top1_agreement": round(self.agree / self.rows, 4),
            "top1_disagreements": self.rows - self.agree,
            "positions": self.rows,
            f"top1_agreement_margin_gt_{MARGIN}": round(self.clear_agree / self.clear, 4) if self.clear else None,
            f"positions_margin_gt_{MARGIN}": self.clear,
            "worst_position": self.worst,
        }


def chunked_logits(model, tokens: list[int], chunk: int) -> np.ndarray:
    """``[len(tokens), vocab]`` logits of ``tokens`` prefilled ``chunk`` at a time on one fresh
    cache (each step attends over the cache written by the earlier ones)."""
    n = len(tokens)
    blocks = -(-n // 16)
    cache = model.new_kv_cache(blocks)
    windows = [layer.window for layer in model.kv_spec().layers]
    rows = []
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        step = SimpleNamespace(
            input_ids=np.asarray(tokens[start:end], np.int64),
            positions=np.arange(start, end, dtype=np.int64),
            slot_mapping=np.arange(start, end, dtype=np.int64),
            query_start_loc=np.array([0, end - start], np.int32),
            context_lens=np.array([end], np.int32),
            block_tables=np.arange(blocks, dtype=np.int32)[None],
            copy_ops=[],
            logits_indices=np.arange(end - start, dtype=np.int64),
        )
        rows.append(model.forward(CacheStep(step, cache, windows=windows)))
    return np.concatenate(rows)


def sequences(name: str, max_tokens: int) -> dict[str, list[int]]:
    golden_file, prompts = MODELS[name]
    golden = json.loads((ROOT / "tests" / "data" / golden_file).read_text())
    chosen = {}
    for prompt in prompts:
        record = golden["prompts"][prompt]
        chosen[prompt] = (record["prompt_token_ids"] + record["expected_token_ids"])[:max_tokens]
    return chosen


def llama_logits(tool: Path, gguf: Path, seqs: dict[str, list[int]], flags: list[str], threads: int, out: Path) -> dict:
    """llama.cpp's logits, sequence by sequence, read from the tool's .npy ``out`` (memory-mapped:
    each run needs a file of its own)."""
    ids = out.with_suffix(".txt")
    ids.write_text("".join(" ".join(map(str, tokens)) + "\n" for tokens in seqs.values()))
    subprocess.run([str(tool), str(gguf), str(ids), str(out), "--threads", str(threads), *flags], check=True)
    matrix = np.load(out, mmap_mode="r")
    rows, start = {}, 0
    for name, tokens in seqs.items():
        rows[name] = matrix[start : start + len(tokens)]
        start += len(tokens)
    assert start == matrix.shape[0], (start, matrix.shape)
    return rows


def compare_model(name: str, tool: Path, quantize: Path | None, threads: int, max_tokens: int, chunk: int, workdir: Path) -> dict:
    gguf = locate_registered(name)
    seqs = sequences(name, max_tokens)
    logits: dict[str, dict[str, np.ndarray]] = {}
    timings = {}
    for config, flags in LLAMA_CONFIGS.items():
        started = time.perf_counter()
        logits[f"llama_{config}"] = llama_logits(tool, gguf, seqs, flags, threads, workdir / f"{name}-{config}.npy")
        timings[f"llama_{config}"] = round(time.perf_counter() - started, 2)
    if quantize is not None:
        started = time.perf_counter()
        f32 = workdir / f"{gguf.stem}-F32.gguf"
        subprocess.run([str(quantize), "--allow-requantize", str(gguf), str(f32), "F32", str(threads)],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        flags = LLAMA_CONFIGS["f32_attention"]
        logits["llama_f32_file"] = llama_logits(tool, f32, seqs, flags, threads, workdir / f"{name}-f32-file.npy")
        f32.unlink()
        timings["llama_f32_file"] = round(time.perf_counter() - started, 2)
    for dtype in ("auto", "float32"):
        started = time.perf_counter()
        model, _ = load_model(name, weight_dtype=dtype)
        logits[f"pagedkv_{dtype}"] = {seq: prefill_logits(model, tokens) for seq, tokens in seqs.items()}
        timings[f"pagedkv_{dtype}"] = round(time.perf_counter() - started, 2)
        started = time.perf_counter()
        logits[f"pagedkv_{dtype}_chunked"] = {seq: chunked_logits(model, tokens, chunk) for seq, tokens in seqs.items()}
        timings[f"pagedkv_{dtype}_chunked"] = round(time.perf_counter() - started, 2)
        del model
    vocab = {source: next(iter(rows.values())).shape[1] for source, rows in logits.items()}
    if len(set(vocab.values())) != 1:
        raise SystemExit(f"{name}: vocabularies differ: {vocab}")
    pairs = {}
    for candidate, reference in PAIRS:
        if candidate not in logits or reference not in logits:
            continue
        tally = Tally()
        for seq in seqs:
            tally.add(seq, logits[candidate][seq], logits[reference][seq])
        pairs[f"{candidate} vs {reference}"] = tally.report()
    per_sequence = {}
    for seq, tokens in seqs.items():
        per_sequence[seq] = {"tokens": len(tokens)}
        for candidate, reference in PER_SEQUENCE_PAIRS:
            tally = Tally()
            tally.add(seq, logits[candidate][seq], logits[reference][seq])
            report = tally.report()
            per_sequence[seq][f"{candidate} vs {reference}"] = {k: report[k] for k in ("max_abs_diff", "rms_diff")}
    reference = np.concatenate([np.asarray(rows) for rows in logits["llama_default"].values()])
    return {
        "gguf": gguf.name,
        "vocab": next(iter(vocab.values())),
        "positions": sum(len(tokens) for tokens in seqs.values()),
        "logit_std_llama_default": round(float(reference.std()), 3),
        "pairs": pairs,
        "per_sequence": per_sequence,
        "seconds": timings,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool", type=Path, default=ROOT / ".peers" / "bin" / "llama-logits")
    parser.add_argument("--quantize", type=Path, default=ROOT / ".peers" / "bin" / "llama-quantize",
                        help="llama-quantize for the F32 check (skipped if missing)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "model" / "llama_logits.json")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=32, help="prefill chunk of pagedkv_auto_chunked (< 64: the int8 path)")
    args = parser.parse_args()
    if not args.tool.exists():
        raise SystemExit(f"{args.tool} is missing: `make parity-llama` builds it (after `make peers`)")
    pagedkv.set_num_threads(args.threads)
    quantize = args.quantize if args.quantize.exists() else None
    version = (ROOT / ".peers" / "version.txt")
    result = {
        "what": "teacher-forced logits over every position, same GGUF file: pagedkv (weight_dtype auto / float32) vs llama.cpp",
        "llama_cpp": version.read_text().splitlines()[0] if version.exists() else None,
        "llama_configs": {name: " ".join(flags) for name, flags in LLAMA_CONFIGS.items()},
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "margin": MARGIN,
        "models": {},
    }
    with tempfile.TemporaryDirectory(prefix="llama-logits-") as tmp:
        for name in args.models:
            result["models"][name] = compare_model(
                name, args.tool, quantize, args.threads, args.max_tokens, args.chunk, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, model in result["models"].items():
        print(f"{name} ({model['gguf']}, {model['positions']} positions, logit std {model['logit_std_llama_default']}):")
        for pair, figures in model["pairs"].items():
            clear = figures[f"top1_agreement_margin_gt_{MARGIN}"]
            print(f"  {pair:42s} max|Δ| {figures['max_abs_diff']:7.4f}  RMS {figures['rms_diff']:.4f}  "
                  f"top-1 {figures['top1_agreement']:.4f} ({figures['top1_disagreements']} differ)  "
                  f"margin>{MARGIN}: {clear} of {figures[f'positions_margin_gt_{MARGIN}']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
