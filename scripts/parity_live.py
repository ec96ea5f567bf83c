"""`make parity`: pagedkv against transformers live, tokens and logits (float32).

Runs in the project venv, on the record that scripts/parity_golden.py has just made in the peers
venv from the same GGUF file (its tokens and every step's logits). pagedkv runs through
:class:`~pagedkv.engine.EngineCore` with a runner that keeps the logits it samples from, in
two configurations: every prompt in one batch, and the long prompt in small prefill chunks twice
(the second a prefix-cache hit). Each must give transformers' tokens, with logits within
``--atol`` (default 1e-4) at every step up to the first differing token. The committed golden
file is also checked against the live record, so a change in transformers shows as such.
Exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from pagedkv.engine import EngineConfig, EngineCore, PagedModelRunner
from pagedkv.loaders import load_pretrained
from pagedkv.models import LlamaModel
from pagedkv.sampling import SamplingParams, sample


class RecordingRunner(PagedModelRunner):
    """A paged runner that also keeps, per request, the logits row of every token it samples."""

    def __init__(self, model: LlamaModel, config: EngineConfig) -> None:
        super().__init__(model, config.num_blocks, config.block_size, config.kv_dtype)
        self.logits: dict[str, list[np.ndarray]] = defaultdict(list)

    def run(self, step, params, generators):
        logits = self.model.forward(step, self.kv_cache)
        for request_id, row in zip(step.sample_request_ids, logits, strict=False):
            self.logits[request_id].append(np.array(row, dtype=np.float32))
        return sample(logits, params, generators)


def run_core(model: LlamaModel, config: EngineConfig, requests: list[tuple[str, list[int]]], params: SamplingParams,
             sequential: bool) -> tuple[dict[str, list[int]], dict[str, np.ndarray], dict[str, float]]:
    """New tokens and logits of each (id, prompt); ``sequential`` runs each to its end before the next."""
    runner = RecordingRunner(model, config)
    core = EngineCore(runner, config, eos_token_id=model.config.eos_token_ids[0])
    tokens: dict[str, list[int]] = {}
    batches = [[r] for r in requests] if sequential else [requests]
    for batch in batches:
        for request_id, prompt in batch:
            core.add_request(request_id, prompt, params)
        while core.has_unfinished():
            for output in core.step()[1]:
                tokens[output.request_id] = output.outputs[0].token_ids
    return tokens, {k: np.stack(v) for k, v in runner.logits.items()}, core.stats()


def compare(name: str, got: list[int], logits: np.ndarray, expected: list[int], reference: np.ndarray,
            atol: float) -> tuple[bool, str]:
    diverged = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    same_tokens = got == expected
    upto = len(expected) if diverged is None else diverged + 1
    upto = min(upto, len(logits), len(reference))
    error = float(np.max(np.abs(logits[:upto] - reference[:upto])))
    top2 = np.sort(reference[:upto], axis=-1)[:, -2:]
    margin = float(np.min(top2[:, 1] - top2[:, 0]))
    ok = same_tokens and error <= atol
    detail = "tokens equal" if same_tokens else f"first difference at new token {diverged}"
    return ok, f"{name:24s} {len(got):3d} tokens  max |Δlogit| {error:.2e}  min top-1 margin {margin:7.4f}  {detail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--live", type=Path, required=True, help="the record parity_golden.py just wrote")
    parser.add_argument("--logits", type=Path, required=True, help="its logits (.npz)")
    parser.add_argument("--golden", type=Path, default=Path("tests/data/smollm2_golden.json"))
    parser.add_argument("--atol", type=float, default=1e-4)
    args = parser.parse_args()
    live = json.loads(args.live.read_text())
    reference = np.load(args.logits)
    prompts = live["prompts"]
    committed = json.loads(args.golden.read_text())["prompts"]
    failures = 0

    for name, record in prompts.items():
        if name not in committed or committed[name]["expected_token_ids"] != record["expected_token_ids"]:
            print(f"golden file out of date: {name} differs from transformers {live['recorded_with']['transformers']} now")
            failures += 1

    weights, _ = load_pretrained("smollm2-135m")
    model = LlamaModel(weights)
    params = SamplingParams(max_tokens=live["max_new_tokens"], temperature=0.0, stop_token_ids=tuple(live["eos_token_ids"]))
    long = live["long_prompt"]
    runs = {
        "one batch of every prompt": (
            EngineConfig(num_blocks=256), [(n, p["prompt_token_ids"]) for n, p in prompts.items()], False),
        "long prompt, 64-token chunks, then a prefix hit": (
            EngineConfig(num_blocks=128, max_num_batched_tokens=64),
            [(f"{long}#{i}", prompts[long]["prompt_token_ids"]) for i in range(2)],
            True,
        ),
    }
    for title, (config, requests, sequential) in runs.items():
        tokens, logits, stats = run_core(model, config, requests, params, sequential)
        print(f"== {title} (prefix hit tokens {stats['prefix_hit_tokens']:.0f})")
        for request_id, _ in requests:
            name = request_id.split("#")[0]
            ok, line = compare(request_id, tokens[request_id], logits[request_id], prompts[name]["expected_token_ids"],
                               reference[name], args.atol)
            failures += not ok
            print(("  ok   " if ok else "  FAIL ") + line)
    print("parity: " + ("all equal" if not failures else f"{failures} failure(s)") + f" (atol {args.atol:g}, transformers "
          f"{live['recorded_with']['transformers']}, torch {live['recorded_with']['torch']})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
