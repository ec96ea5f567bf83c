"""Writes a Llama GGUF file (by default the registry's SmolLM2-135M-Instruct) as a Hugging Face
checkpoint directory, for peers that cannot read GGUF (vLLM's `bench http` peer; `make peers`):
config.json and model.safetensors (pagedkv's save_checkpoint), tokenizer.json and
tokenizer_config.json with the GGUF's chat template, generation_config.json.

Run with the project's python (it uses pagedkv's GGUF loader and tokenizer builder, so the peer
gets the very weights and vocabulary pagedkv serves). The weights are dequantized to float32 and
stored as float32 by default: Q4_1 values are not all bfloat16 values, and a server that computes
in bfloat16 rounds them itself. The directory is written beside ``--out`` and renamed into place
last, so an interrupted run leaves nothing that looks complete.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from pagedkv.loaders.checkpoint import save_checkpoint
from pagedkv.loaders.gguf import load_gguf
from pagedkv.loaders.gguf_file import read_gguf
from pagedkv.loaders.registry import locate_registered


def convert(gguf: Path, out: Path, dtype: str) -> None:
    weights, tokenizer = load_gguf(gguf)
    metadata = read_gguf(gguf).metadata
    config = weights.config
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(weights, tmp, dtype=dtype)
    hf_config = json.loads((tmp / "config.json").read_text())
    hf_config["dtype"] = dtype  # what the weights are stored in; servers that read it pick it for --dtype auto
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")

    # The `tokenizers` object pagedkv built from the GGUF vocabulary, merges and pre-tokenizer.
    tokenizer._tokenizer.save(str(tmp / "tokenizer.json"))
    tokens = metadata["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if isinstance(index, int) else None

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
        "chat_template": tokenizer.chat_template,
    }
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    eos = list(config.eos_token_ids)
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos}
    if isinstance(metadata.get("tokenizer.ggml.padding_token_id"), int):
        generation["pad_token_id"] = metadata["tokenizer.ggml.padding_token_id"]
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, help="the GGUF file (default: the registry's smollm2-135m)")
    parser.add_argument("--out", type=Path, required=True, help="the checkpoint directory to write")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="on-disk weight type")
    args = parser.parse_args()
    gguf = args.gguf or locate_registered("smollm2-135m")
    convert(gguf, args.out, args.dtype)
    print(f"wrote {args.out} from {gguf.name} ({args.dtype})")


if __name__ == "__main__":
    main()
