"""The transformers peer of `python -m lab bench model`: SmolLM2-135M from the same GGUF file,
float32 on the CPU, timed one round per line read on stdin, so that the bench can interleave its
rounds with pagedkv's and llama.cpp's.

Runs in the peers venv (torch, transformers, gguf). It loads once, then for every input line
prints one JSON line of tokens/s: ``decode`` (one request, greedy, decode steps only: the time of
``new`` tokens minus that of 1, which is the prefill), ``prompt`` (one forward over a
``prompt_tokens`` prompt) and ``batch_<n>`` (aggregate decode of ``n`` requests of
``batch_prompt`` tokens generating ``new`` tokens each, again minus the prefill). Prompts are
random token ids, so no two requests share a prefix. ``--threads`` sets torch's threads (0:
torch's default).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as transformers_logging


def generate_seconds(model, ids: torch.Tensor, new: int) -> float:
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new, min_new_tokens=new,
                   pad_token_id=0, temperature=None, top_p=None, top_k=None)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--batch-prompt", type=int, default=40)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--batches", default="4,16,32")
    args = parser.parse_args()
    transformers_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    directory, _, name = args.gguf.rpartition("/")
    model = AutoModelForCausalLM.from_pretrained(directory or ".", gguf_file=name, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)

    def prompts(n: int, length: int) -> torch.Tensor:
        return torch.randint(3, vocab, (n, length), generator=generator)

    def decode_rate(n: int, length: int) -> float:
        ids = prompts(n, length)
        prefill = generate_seconds(model, ids, 1)
        return n * (args.new - 1) / max(generate_seconds(model, ids, args.new) - prefill, 1e-9)

    with torch.inference_mode():
        decode_rate(1, 8)  # warm-up
        print(json.dumps({"ready": True, "threads": torch.get_num_threads(), "torch": torch.__version__}), flush=True)
        for _ in sys.stdin:
            row = {"decode": decode_rate(1, args.batch_prompt)}
            ids = prompts(1, args.prompt_tokens)
            start = time.perf_counter()
            model(ids)
            row["prompt"] = args.prompt_tokens / (time.perf_counter() - start)
            for n in (int(b) for b in args.batches.split(",")):
                row[f"batch_{n}"] = decode_rate(n, args.batch_prompt)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
