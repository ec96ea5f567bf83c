"""Records Hugging Face transformers' greedy tokens on SmolLM2-135M-Instruct or Gemma 3 270M: the
golden files that tests/models/test_parity.py and test_gemma3_parity.py hold pagedkv to (`make
parity-golden`), and the logits that scripts/parity_live.py compares with pagedkv's (`make parity`).

Gemma 3 is a base model (no chat template): its prompts are the texts, plus a long one (over
2,000 tokens: four times the window of its sliding layers) built from the passage below.

Runs in the peers venv (.venv-peers: torch, transformers, gguf), never in the project's. It
loads the very GGUF file pagedkv loads, through ``AutoModelForCausalLM.from_pretrained(dir,
gguf_file=...)``, which dequantizes it; the model is checked to be float32 throughout. Prompts are
defined here once; the golden file stores their token ids as transformers' tokenizer (from the
same GGUF) made them, chat prompts rendered by its ``apply_chat_template(add_generation_prompt=True)``.
Generation is greedy and stops at eos as usual (``generation_config.eos_token_id``), so a record
ends either at its first eos (``finish_reason == "eos"``, the eos token included) or after
``max_new_tokens``. Each step's top-1 minus top-2 logit margin is kept: a near-tie is the only
acceptable reason for another implementation to pick a different token there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as transformers_logging

MAX_NEW_TOKENS = 32

# A passage long enough (over 500 tokens) to need several prefill chunks and fill many blocks.
LONG_PASSAGE = """\
The lighthouse keeper on the northern island kept a logbook for forty years, and every entry \
followed the same pattern. First came the date and the hour, then the direction and strength of \
the wind, then the state of the sea, and last a line or two about anything unusual: a ship that \
passed too close to the rocks, a flock of birds that arrived early, a storm that broke the glass \
of the lantern room. The keeper was not a writer, and the sentences are short and plain, but \
read together they tell the story of a place that changed slowly and then all at once.

In the first decade the island had no electricity. The lamp burned paraffin, and the keeper \
climbed the tower four times a night to trim the wick and wind the clockwork that turned the \
lens. Supplies came by boat once a month in summer and once every two months in winter, when \
the crossing was dangerous. The logbook records three winters in which the boat did not come at \
all for ten weeks, and the keeper lived on dried fish, oats and rainwater collected from the \
roof of the cottage.

In the second decade a generator arrived, and with it a radio. The entries grow longer. The \
keeper begins to note the weather forecasts read out from the mainland, and to compare them with \
what actually happened on the island. The forecasts were often wrong. Fog that was promised did \
not come; gales that nobody predicted tore the roof off the storage shed twice in one autumn. \
The keeper writes, with some satisfaction, that the barometer on the kitchen wall was a better \
guide than any voice on the radio.

The third decade brought visitors. A research station was built on the eastern cliffs to count \
seabirds, and young scientists stayed on the island every summer. The keeper taught them to read \
the sea, to tell a swell that would pass from one that would build, and to respect the currents \
around the southern point, where two boats had been lost before the lighthouse was built. In \
return they brought newspapers, books and, once, a small telescope that the keeper used to watch \
the moons of Jupiter on clear winter nights.

In the last decade the light was automated. An engineer came from the mainland, replaced the \
lamp with an electric beacon controlled by a timer and a light sensor, and connected it to a \
monitoring system that reported faults by radio. The keeper stayed on for two more years as a \
caretaker, but the logbook entries become sparse. The final entry records a calm sea, a light \
westerly wind and a single line: the light no longer needs me, but I will miss the light.
"""

CHATS: dict[str, list[dict[str, str]]] = {
    "chat_boiling_point": [{"role": "user", "content": "What is the boiling point of water at sea level?"}],
    "chat_planets": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three planets in our solar system."},
    ],
    "chat_haiku": [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    "chat_arithmetic": [{"role": "user", "content": "What is 12 plus 30? Reply with only the number."}],
    "chat_long_summary": [
        {"role": "user", "content": "Summarize the following passage in two sentences.\n\n" + LONG_PASSAGE}
    ],
}
TEXTS: dict[str, str] = {
    "text_capital": "The capital of France is",
    "text_counting": "One, two, three, four,",
    "text_story": "Once upon a time, in a small village by the sea,",
    "text_code": "def fibonacci(n):\n    ",
    "text_colors": "The three primary colors are",
}
LONG_PROMPT = "chat_long_summary"

# Gemma 3's long prompt: past its 512-token window four times over, so the sliding layers see only
# the last part of it while the global layers see it all.
GEMMA3_LONG_PROMPT = "text_long_logbook"
GEMMA3_LONG_TEXT = (LONG_PASSAGE + "\n\n").join(
    ["Four copies of a keeper's logbook summary follow.\n\n", "", "", "", "Which decade brought visitors?"])


def load(gguf: Path):
    """transformers' model and tokenizer from the GGUF file, the model in float32 on the CPU."""
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.float32}:
        raise SystemExit(f"transformers loaded {gguf.name} as {dtypes}, not float32")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model, tokenizer


def prompt_ids(tokenizer, model_name: str) -> dict[str, dict[str, object]]:
    """Every prompt's record: kind, source (text or messages) and token ids."""
    prompts: dict[str, dict[str, object]] = {}
    texts = TEXTS | ({GEMMA3_LONG_PROMPT: GEMMA3_LONG_TEXT} if model_name == "gemma3" else {})
    for name, text in texts.items():
        prompts[name] = {"kind": "text", "text": text, "prompt_token_ids": tokenizer(text)["input_ids"]}
    if model_name == "gemma3":
        return prompts
    for name, messages in CHATS.items():
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        prompts[name] = {"kind": "chat", "messages": messages, "prompt_token_ids": [int(t) for t in ids]}
    return prompts


@torch.inference_mode()
def greedy(model, ids: list[int], eos_ids: list[int]) -> tuple[list[int], str, np.ndarray]:
    """transformers' greedy continuation of ``ids``, why it ended, and each step's logits."""
    inputs = torch.tensor([ids])
    out = model.generate(
        inputs,
        attention_mask=torch.ones_like(inputs),
        do_sample=False,
        max_new_tokens=MAX_NEW_TOKENS,
        eos_token_id=eos_ids,
        pad_token_id=eos_ids[0],
        output_logits=True,
        return_dict_in_generate=True,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    new = out.sequences[0, len(ids):].tolist()
    logits = torch.stack(out.logits, dim=1)[0].float().numpy()  # [steps, vocab], raw (unprocessed)
    finish = "eos" if new and new[-1] in eos_ids else "length"
    return new, finish, logits


def margins(logits: np.ndarray) -> list[float]:
    """Top-1 minus top-2 logit at each step."""
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return [round(float(m), 5) for m in top2[:, 1] - top2[:, 0]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, required=True, help="the GGUF file pagedkv loads")
    parser.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2", help="which prompt set")
    parser.add_argument("--out", type=Path, required=True, help="the golden JSON file to write")
    parser.add_argument("--logits", type=Path, help="also write every step's logits here (.npz), for make parity")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("PARITY_THREADS", "2")))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers_logging.disable_progress_bar()

    model, tokenizer = load(args.gguf)
    eos = model.generation_config.eos_token_id
    eos_ids = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    prompts = prompt_ids(tokenizer, args.model)
    long_prompt = GEMMA3_LONG_PROMPT if args.model == "gemma3" else LONG_PROMPT
    long_min = 2000 if args.model == "gemma3" else 500
    all_logits: dict[str, np.ndarray] = {}
    for name, record in prompts.items():
        new, finish, logits = greedy(model, record["prompt_token_ids"], eos_ids)
        record.update(expected_token_ids=new, finish_reason=finish, num_new_tokens=len(new), top1_margins=margins(logits))
        all_logits[name] = logits
        print(f"{name}: {len(record['prompt_token_ids'])} prompt tokens -> {len(new)} new ({finish}), "
              f"min margin {min(record['top1_margins']):.4f}: {tokenizer.decode(new)!r}")
    if len(prompts[long_prompt]["prompt_token_ids"]) < long_min:
        raise SystemExit(f"the long prompt has only {len(prompts[long_prompt]['prompt_token_ids'])} tokens")

    golden = {
        "model": args.gguf.name,
        "recorded_with": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "dtype": "float32",
            "threads": args.threads,
        },
        "max_new_tokens": MAX_NEW_TOKENS,
        "eos_token_ids": eos_ids,
        "long_prompt": long_prompt,
        "text_config": {key: value for key, value in model.config.to_dict().items()
                        if key in ("sliding_window", "rope_local_base_freq", "layer_types", "rope_parameters",
                                   "query_pre_attn_scalar", "rope_theta")},
        "prompts": prompts,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n")
    if args.logits:
        args.logits.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(args.logits, **all_logits)
    print(f"wrote {args.out}" + (f" and {args.logits}" if args.logits else ""))


if __name__ == "__main__":
    main()
