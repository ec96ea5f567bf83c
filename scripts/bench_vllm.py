"""The vLLM peer of `python -m lab bench model`: SmolLM2-135M on vLLM's CPU build (offline
``vllm.LLM``, the GGUF converted to a Hugging Face directory by `make peers-vllm`), timed one
round per line read on stdin, so that the bench can interleave its rounds with the others'.

Runs in .venv-vllm. It loads once, then for every input line prints one JSON line of tokens/s,
defined as scripts/bench_transformers.py defines them: ``decode`` (one request, greedy, the time
of ``new`` tokens minus that of 1, which is the prefill), ``prompt`` (a ``prompt_tokens`` prompt
generating 1 token) and ``batch_<n>`` (aggregate decode of ``n`` requests of ``batch_prompt``
tokens generating ``new`` each, minus their prefill). Prompts are random token ids. vLLM's CPU
settings (KV space, thread binding) come from the environment the bench gives it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_serve  # noqa: E402,F401 - answers the wheel's metadata lookup under the name "vllm" (see there)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the Hugging Face directory")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--batch-prompt", type=int, default=40)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--batches", default="4,16,32")
    args = parser.parse_args()
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    batches = [int(b) for b in args.batches.split(",")]
    # Token ids in and out, no text: pagedkv's EngineCore and llama-bench detokenize nothing either.
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.prompt_tokens + args.new + 16,
              max_num_seqs=max(batches), enable_prefix_caching=False, seed=0, skip_tokenizer_init=True)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(0)

    def prompts(n: int, length: int) -> list[TokensPrompt]:
        return [TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(length)]) for _ in range(n)]

    def seconds(batch: list[TokensPrompt], new: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        took = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == new for o in outputs), "a request ended early"
        return took

    def decode_rate(n: int) -> float:
        batch = prompts(n, args.batch_prompt)
        prefill = seconds(batch, 1)
        return n * (args.new - 1) / max(seconds(batch, args.new) - prefill, 1e-9)

    for n in batches:  # warm-up at every batch size (first-use costs stay out of round 1)
        decode_rate(n)
    print(json.dumps({"ready": True, "vllm": __version__, "dtype": args.dtype}), flush=True)
    for _ in sys.stdin:
        row = {"decode": decode_rate(1), "prompt": args.prompt_tokens / seconds(prompts(1, args.prompt_tokens), 1)}
        for n in batches:
            row[f"batch_{n}"] = decode_rate(n)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
