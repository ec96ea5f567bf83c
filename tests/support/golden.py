"""A golden file of transformers' greedy tokens (``make parity-golden``) and the engine runs the
parity tests check against it: :class:`Golden`.

The file holds ``prompts`` (each with ``prompt_token_ids``, ``expected_token_ids``,
``top1_margins``, ``finish_reason``), ``long_prompt`` (the name of the longest), ``max_new_tokens``
and ``eos_token_ids``.
"""

from __future__ import annotations

import json
from pathlib import Path

from pagedkv.engine import Engine, EngineConfig
from pagedkv.sampling import SamplingParams

# transformers ends at eos with the eos token kept, pagedkv says "stop"; else both run to the limit.
FINISH = {"eos": "stop", "length": "length"}


class Golden:
    """The golden file ``tests/data/<name>``."""

    def __init__(self, name: str) -> None:
        self.data: dict = json.loads((Path(__file__).parent.parent / "data" / name).read_text())
        self.prompts: dict[str, dict] = self.data["prompts"]
        self.long: str = self.data["long_prompt"]

    def greedy(self) -> SamplingParams:
        """transformers' generation: greedy, to ``max_new_tokens`` or an eos token."""
        return SamplingParams(max_tokens=self.data["max_new_tokens"], temperature=0.0,
                              stop_token_ids=tuple(self.data["eos_token_ids"]))

    def run(self, model_and_tokenizer: tuple, config: EngineConfig, names: list[str],
            timeout: float = 600) -> tuple[dict[str, list[int]], dict[str, str], dict[str, float]]:
        """Every named prompt submitted at once; their new tokens, finish reasons and the engine's stats."""
        model, tokenizer = model_and_tokenizer
        engine = Engine(model, tokenizer, config)
        try:
            handles = {name: engine.submit(self.prompts[name]["prompt_token_ids"], self.greedy()) for name in names}
            outputs = {name: handle.result(timeout=timeout) for name, handle in handles.items()}
            stats = engine.stats()
        finally:
            engine.shutdown(timeout=60)
        return ({name: out.outputs[0].token_ids for name, out in outputs.items()},
                {name: out.outputs[0].finish_reason for name, out in outputs.items()}, stats)

    def check(self, tokens: dict[str, list[int]], finish: dict[str, str]) -> None:
        """Each prompt's tokens and finish reason are the file's (naming the first difference and
        transformers' top-1 margin there)."""
        for name, got in tokens.items():
            expected = self.prompts[name]["expected_token_ids"]
            diverged = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
            margin = None if diverged is None else self.prompts[name]["top1_margins"][diverged]
            assert got == expected, f"{name}: first difference at new token {diverged} (transformers' top-1 margin: {margin})"
            assert finish[name] == FINISH[self.prompts[name]["finish_reason"]], name
