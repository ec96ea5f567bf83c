"""Structured outputs' costs (issue 22's measures) on SmolLM2-135M (49,152 tokens) and Gemma 3 270M
(262,144 tokens), each model in turn:

- the vocabulary (the tokenizer's bytes per token, ``GrammarCompiler.vocabulary``), built once;
- each JSON schema of ``tests/data/json_schemas.json`` compiled fresh (``_core.Grammar``, no
  cache), alone and with its first mask (``start_masks(...).wait()``): llguidance builds its
  lexer lazily, so a constraint's first-token latency is the two together. Median, p95 and max
  over the schemas of each schema's median over ``--repeats``; the issue's goal: ≤ 50 ms for a
  typical schema;
- per decode step at each batch size (1 and 16): ``EngineCore`` stepped here, greedy, over
  ``--new-tokens`` tokens, unconstrained (eos ignored) against the same prompts each constrained
  by an array of at least 4 of one of 16 API payload schemas of the corpus (so no output ends
  before the limit and both runs decode the same number of tokens). Step times count decode
  steps only (a step that prefills is left out). Reported: both runs' tokens/s and their ratio;
  the masks alone, their cost: the constrained outputs replayed through fresh matchers,
  ``start_masks`` + ``wait`` for the batch's matchers once per token, mean and p95 over the
  steps, against the unconstrained step time; and the engine's own figures per masked step: the
  masks' compute time on the worker pool (summed over the batch's rows) and the time the step
  waited for them (what the forward pass did not hide). The issue's goal: masks ≤ 5% of the step time, overlapped with
  the forward pass.

Rounds alternate unconstrained and constrained runs; each figure is the median over ``--rounds``,
reported with the machine's load average (the figures mean little on a loaded machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import pagedkv
from pagedkv._core import Grammar, start_masks
from pagedkv.cli import comma_list, positive_int
from pagedkv.engine import EngineConfig, EngineCore, PagedModelRunner, RequestOutput
from pagedkv.grammar import GrammarCompiler, StructuredOutputs
from pagedkv.loaders import load_model
from pagedkv.models import PagedDecoder
from pagedkv.sampling import SamplingParams
from pagedkv.text.tokenizer import Tokenizer

MODELS = ("smollm2-135m", "gemma3-270m")
CORPUS = Path(__file__).resolve().parents[2] / "tests" / "data" / "json_schemas.json"
# Realistic payloads of the corpus without $ref (their array wrapper would break the pointers),
# each at least ~20 tokens: at least 4 of them outlast the decode run.
PAYLOADS = (
    "invoice", "calendar_event", "search_query", "product_listing", "recipe", "movie_review", "flight_booking",
    "log_entry", "api_error", "github_issue", "nested_address", "user_preferences", "order_with_status_history",
    "service_config", "entity_extraction", "bank_transaction",
)
MIN_PAYLOADS = 4
COMPILE_GOAL_MS = 50.0
MASK_GOAL_PERCENT = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=comma_list(model_name), default=MODELS, help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--batches", type=comma_list(positive_int), default=None, help="decode batch sizes (default 1,16)")
    parser.add_argument("--new-tokens", type=positive_int, default=None, help="tokens per request (default 64)")
    parser.add_argument("--rounds", type=positive_int, default=None, help="engine rounds per batch (default 5)")
    parser.add_argument("--repeats", type=positive_int, default=None, help="compiles per schema (default 5)")
    parser.add_argument("--schemas", type=Path, default=CORPUS, help="the JSON schema corpus")
    parser.add_argument("--weight-dtype", default="auto", help="as load_model takes it (default: as the GGUF ships)")
    parser.add_argument("--quick", action="store_true", help="1 round and 1 compile each, batches 1,4, 16 tokens")
    parser.add_argument("--json", action="store_true", help="print JSON only on stdout (the table goes to stderr)")


def model_name(text: str) -> str:
    if text not in MODELS:
        raise argparse.ArgumentTypeError(f"unknown model {text!r}: choose among {', '.join(MODELS)}")
    return text


def distribution(values: Sequence[float], names: Sequence[str]) -> dict[str, Any]:
    """Median, p95 (nearest rank), max and which item was the max, in ms rounded to µs."""
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, int(np.ceil(0.95 * len(ordered))) - 1)]
    return dict(median=round(statistics.median(values), 3), p95=round(p95, 3), max=round(ordered[-1], 3),
                slowest=names[int(np.argmax(values))])


def compile_latency(compiler: GrammarCompiler, corpus: list[dict[str, Any]], repeats: int) -> dict[str, Any]:
    """Each schema compiled fresh ``repeats`` times, alone and with its first mask."""
    vocabulary = compiler.vocabulary()
    alone, with_mask = [], []
    for entry in corpus:
        arguments = StructuredOutputs(json=entry["schema"]).compile_arguments()
        compile_ms, first_ms = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            grammar = Grammar(vocabulary, **arguments)
            compiled = time.perf_counter()
            start_masks([grammar.matcher()]).wait()
            done = time.perf_counter()
            compile_ms.append((compiled - started) * 1e3)
            first_ms.append((done - started) * 1e3)
        alone.append(statistics.median(compile_ms))
        with_mask.append(statistics.median(first_ms))
    names = [entry["name"] for entry in corpus]
    return dict(schemas=len(corpus), repeats=repeats, compile_ms=distribution(alone, names),
                compile_and_first_mask_ms=distribution(with_mask, names), goal_ms=COMPILE_GOAL_MS)


def payload_constraint(entry: dict[str, Any]) -> StructuredOutputs:
    return StructuredOutputs(json={"type": "array", "minItems": MIN_PAYLOADS, "items": entry["schema"]})


def decode_run(core: EngineCore, tokenizer: Tokenizer, prompts: Sequence[str], constraints: Sequence[StructuredOutputs | None],
               new_tokens: int) -> dict[str, Any]:
    """One request per prompt, all added before the first step; decode steps timed."""
    before = core.stats()
    for i, (prompt, constraint) in enumerate(zip(prompts, constraints, strict=True)):
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=constraint is None,
                                structured_outputs=constraint)
        core.add_request(f"r{i}", tokenizer.encode(prompt), params)
    decode_seconds, decode_steps, decoded = 0.0, 0, 0
    outputs: dict[str, RequestOutput] = {}
    while core.has_unfinished():
        started = time.perf_counter()
        events, ended = core.step()
        seconds = time.perf_counter() - started
        outputs.update((o.request_id, o) for o in ended)
        assert core.last_step is not None, "a step ran"
        if not core.last_step.stats["num_prefill_tokens"]:
            decode_seconds += seconds
            decode_steps += 1
            decoded += len(events)
    after = core.stats()
    masked_steps = after["grammar_mask_steps"] - before["grammar_mask_steps"]
    per_masked_step = 1e3 / masked_steps if masked_steps else 0.0
    return dict(
        tok_s=decoded / decode_seconds,
        step_ms=decode_seconds / decode_steps * 1e3,
        compute_ms=(after["grammar_mask_seconds"] - before["grammar_mask_seconds"]) * per_masked_step,
        wait_ms=(after["grammar_mask_wait_seconds"] - before["grammar_mask_wait_seconds"]) * per_masked_step,
        tokens=[outputs[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))],
        finish=sorted({c.finish_reason for o in outputs.values() for c in o.outputs}),
    )


def replay(compiler: GrammarCompiler, constraints: Sequence[StructuredOutputs], outputs: Sequence[Sequence[int]]) -> tuple[
    list[float], list[float]
]:
    """Fresh matchers replaying ``outputs``: the time (ms) of each step's masks alone (the batch's
    started and collected once per token), and of advancing the batch's matchers past the
    step's tokens (what the engine does on its own thread, as it appends them)."""
    matchers = [compiler.compile(constraint).matcher() for constraint in constraints]
    masks, advances = [], []
    for step in range(min(len(tokens) for tokens in outputs)):
        started = time.perf_counter()
        start_masks(matchers).wait()
        masked = time.perf_counter()
        for matcher, tokens in zip(matchers, outputs, strict=True):
            matcher.advance(tokens[step])
        advances.append((time.perf_counter() - masked) * 1e3)
        masks.append((masked - started) * 1e3)
    return masks, advances


def decode_costs(model: PagedDecoder, tokenizer: Tokenizer, corpus: dict[str, dict[str, Any]], batch: int,
                 new_tokens: int, rounds: int) -> dict[str, Any]:
    """Unconstrained against constrained decoding of ``batch`` requests, alternated ``rounds`` times."""
    config = EngineConfig(max_num_seqs=batch, enable_prefix_caching=False)
    core = EngineCore(PagedModelRunner(model), config, eos_token_ids=model.config.eos_token_ids, tokenizer=tokenizer)
    entries = [corpus[PAYLOADS[i % len(PAYLOADS)]] for i in range(batch)]
    prompts = [entry["prompt"] for entry in entries]
    constraints = [payload_constraint(entry) for entry in entries]
    decode_run(core, tokenizer, prompts[:1], constraints[:1], 4)  # warm-up: the pools, the weights paged in
    free, bound, mask_means, mask_p95s, advance_means, finish = [], [], [], [], [], set()
    for _ in range(rounds):
        free.append(decode_run(core, tokenizer, prompts, [None] * batch, new_tokens))
        bound.append(decode_run(core, tokenizer, prompts, constraints, new_tokens))
        masks, advances = replay(core.grammars, constraints, bound[-1]["tokens"])
        mask_means.append(statistics.mean(masks))
        advance_means.append(statistics.mean(advances))
        mask_p95s.append(float(np.percentile(masks, 95)))
        finish.update(bound[-1]["finish"])

    def median(runs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(run[key] for run in runs)

    step_ms, mask_ms = median(free, "step_ms"), statistics.median(mask_means)
    return dict(
        batch=batch,
        new_tokens=new_tokens,
        constrained_finish=sorted(finish),
        unconstrained_tok_s=round(median(free, "tok_s"), 1),
        constrained_tok_s=round(median(bound, "tok_s"), 1),
        ratio=round(median(bound, "tok_s") / median(free, "tok_s"), 3),
        unconstrained_step_ms=round(step_ms, 3),
        constrained_step_ms=round(median(bound, "step_ms"), 3),
        mask_mean_ms=round(mask_ms, 3),
        mask_p95_ms=round(statistics.median(mask_p95s), 3),
        mask_percent_of_step=round(100 * mask_ms / step_ms, 2),
        advance_mean_ms=round(statistics.median(advance_means), 3),
        engine_mask_compute_ms=round(median(bound, "compute_ms"), 3),
        engine_mask_wait_ms=round(median(bound, "wait_ms"), 3),
        wait_percent_of_step=round(100 * median(bound, "wait_ms") / step_ms, 2),
        goal_percent=MASK_GOAL_PERCENT,
    )


def bench_model(name: str, args: argparse.Namespace, corpus: list[dict[str, Any]]) -> dict[str, Any]:
    model, tokenizer = load_model(name, weight_dtype=args.weight_dtype)
    compiler = GrammarCompiler(tokenizer, model.config.vocab_size, model.config.eos_token_ids)
    started = time.perf_counter()
    compiler.vocabulary()
    vocabulary_ms = (time.perf_counter() - started) * 1e3
    by_name = {entry["name"]: entry for entry in corpus}
    return dict(
        vocab_size=model.config.vocab_size,
        weight_dtype=model.weight_dtype,
        vocabulary_ms=round(vocabulary_ms, 1),
        compile=compile_latency(compiler, corpus, args.repeats),
        decode=[decode_costs(model, tokenizer, by_name, batch, args.new_tokens, args.rounds) for batch in args.batches],
        load_average=os.getloadavg(),
    )


def run(args: argparse.Namespace) -> int:
    args.batches = args.batches or ((1, 4) if args.quick else (1, 16))
    args.new_tokens = args.new_tokens or (16 if args.quick else 64)
    args.rounds = args.rounds or (1 if args.quick else 5)
    args.repeats = args.repeats or (1 if args.quick else 5)
    corpus = json.loads(args.schemas.read_text())
    table = sys.stderr if args.json else sys.stdout
    report: dict[str, Any] = dict(threads=pagedkv.get_num_threads(), load_average_before=os.getloadavg(), models={})
    for name in args.models:
        print(f"== {name}", file=table, flush=True)
        figures = report["models"][name] = bench_model(name, args, corpus)
        print_model(figures, table)
    if args.json:
        print(json.dumps(report))
    return 0


def print_model(figures: dict[str, Any], table) -> None:
    compiled = figures["compile"]
    print(f"  vocabulary of {figures['vocab_size']:,} tokens built in {figures['vocabulary_ms']:.0f} ms; "
          f"{compiled['schemas']} schemas compiled (median of {compiled['repeats']} each)", file=table)
    for key, label in (("compile_ms", "compile"), ("compile_and_first_mask_ms", "compile + first mask")):
        d = compiled[key]
        print(f"    {label:21s} median {d['median']:7.3f} ms  p95 {d['p95']:7.3f} ms  max {d['max']:7.3f} ms ({d['slowest']})",
              file=table)
    for d in figures["decode"]:
        print(f"  batch {d['batch']:2d}: {d['unconstrained_tok_s']:7.1f} tok/s free, {d['constrained_tok_s']:7.1f} constrained "
              f"(×{d['ratio']:.3f}); step {d['unconstrained_step_ms']:.2f} → {d['constrained_step_ms']:.2f} ms; "
              f"masks alone {d['mask_mean_ms']:.3f} ms mean, {d['mask_p95_ms']:.3f} p95 ({d['mask_percent_of_step']:.1f}% of "
              f"the step), advancing {d['advance_mean_ms']:.3f} ms; "
              f"in the engine {d['engine_mask_compute_ms']:.3f} ms computing, "
              f"{d['engine_mask_wait_ms']:.3f} ms waited ({d['wait_percent_of_step']:.1f}%)", file=table)
    print(f"  load average {figures['load_average']}", file=table, flush=True)
