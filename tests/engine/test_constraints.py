"""Structured outputs inside the engine core (issue 22): each constrained sample's matcher
advances on its kept tokens, its masks are computed on the pool during the forward pass and
applied when it samples, a finished grammar ends the sample, and nothing of it reaches the
unconstrained rows. Through the tiny random model (its text is noise, so only the grammar can make
it valid) and the simulated runner (which picks tokens without logits)."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import numpy as np
import pytest

from pagedkv import Engine, InvalidArgumentError
from pagedkv.cluster.feed import continuation
from pagedkv.engine import EngineConfig, EngineCore, PagedModelRunner, SimulatedRunner, VirtualClock
from pagedkv.grammar import GrammarCompiler, StructuredOutputs
from pagedkv.models import LlamaModel, SimulatedModel
from pagedkv.sampling import RowMasks, Samples, SamplingParams
from pagedkv.text.tokenizer import ByteTokenizer

EOS = ByteTokenizer.EOS_ID
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def make_core(weights, **config) -> EngineCore:
    runner = PagedModelRunner(LlamaModel(weights))
    options = {"num_blocks": 64, "block_size": 8} | config
    return EngineCore(runner, EngineConfig(**options), eos_token_ids=[EOS], tokenizer=ByteTokenizer())


def run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]], steps: int = 2000) -> dict:
    for request_id, (prompt, params) in requests.items():
        core.add_request(request_id, prompt, params)
    outputs = {}
    for _ in range(steps):
        _, ended = core.step()
        outputs.update((o.request_id, o) for o in ended)
        if not core.has_unfinished():
            return outputs
    raise AssertionError("the requests never ended")


def prompt(text: str) -> list[int]:
    return ByteTokenizer().encode(text)


def constrained(max_tokens: int = 120, seed: int = 7, **kind) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, structured_outputs=StructuredOutputs(**kind))


def test_noise_is_made_valid_json_regex_and_choice_and_each_sample_ends_with_stop(weights):
    core = make_core(weights)
    outputs = run(core, {
        "json": (prompt("person: "), constrained(json=SCHEMA, max_tokens=200)),
        "regex": (prompt("date: "), constrained(regex=r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]")),
        "choice": (prompt("answer: "), SamplingParams(max_tokens=20, temperature=0.0,
                                                         structured_outputs=StructuredOutputs(choice=["yes", "no", "maybe"]))),
        "lark": (prompt("sum: "), constrained(grammar='start: NUM ("+" NUM)*\nNUM: /[0-9]{1,3}/', max_tokens=12)),
        "n": (prompt("person: "), SamplingParams(max_tokens=200, n=3, seed=3, structured_outputs=StructuredOutputs(json=SCHEMA))),
    })
    assert all(o.error is None for o in outputs.values())
    for completion in outputs["json"].outputs + outputs["n"].outputs:
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), SCHEMA)
        assert list(json.loads(completion.text)) == list(SCHEMA["properties"])  # in the schema's order
    assert len({c.text for c in outputs["n"].outputs}) > 1, "three seeded samples, one text: the matchers are shared"
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]", outputs["regex"].outputs[0].text)
    assert outputs["choice"].outputs[0].text in {"yes", "no", "maybe"}
    assert outputs["choice"].outputs[0].finish_reason == "stop"
    lark = outputs["lark"].outputs[0]
    # A sum may go on: it ends when the model picks the end of sequence, or at the length limit.
    assert re.fullmatch(r"[0-9]{1,3}(\+[0-9]{1,3})*\+?[0-9]{0,3}", lark.text) and lark.finish_reason in {"stop", "length"}
    stats = core.stats()
    assert stats["grammar_compiles"] == 4 and stats["grammar_cache_hits"] == 1  # "n" shares "json"'s grammar
    assert stats["grammar_mask_steps"] > 0 and stats["grammar_mask_rows"] >= stats["grammar_mask_steps"]
    assert 0 <= stats["grammar_mask_wait_seconds"] and 0 < stats["grammar_mask_seconds"]


def test_an_unconstrained_request_beside_constrained_ones_gets_the_tokens_it_gets_alone(weights):
    plain = SamplingParams(max_tokens=24, temperature=0.8, seed=11, logprobs=True, top_logprobs=3, ignore_eos=True)
    alone = run(make_core(weights), {"plain": (prompt("hello"), plain)})["plain"].outputs[0]
    beside = run(make_core(weights), {
        "plain": (prompt("hello"), plain),
        "json": (prompt("hello"), constrained(json=SCHEMA)),
        "choice": (prompt("x"), constrained(choice=["left", "right"])),
    })["plain"].outputs[0]
    assert beside.token_ids == alone.token_ids
    assert beside.logprobs == alone.logprobs


def test_a_constraint_that_does_not_compile_changes_nothing_and_the_engine_serves_on(weights):
    core = make_core(weights)
    for bad in [dict(json={"type": "nonsense"}), dict(regex="(unclosed"), dict(grammar="start: missing_rule"),
                dict(json={"type": "string", "minLength": 5, "maxLength": 2})]:
        with pytest.raises(InvalidArgumentError):
            core.add_request("bad", prompt("x"), constrained(**bad))
        assert not core.has_unfinished()
    assert core.stats()["grammar_rejected"] == 4
    outputs = run(core, {"bad": (prompt("x"), constrained(choice=["ok"]))})  # the id was never taken
    assert outputs["bad"].outputs[0].text == "ok"


def test_structured_outputs_need_a_tokenizer_and_an_end_of_sequence_token(weights):
    runner = PagedModelRunner(LlamaModel(weights))
    without_tokenizer = EngineCore(runner, EngineConfig(num_blocks=16, block_size=8), eos_token_ids=[EOS])
    with pytest.raises(InvalidArgumentError, match="tokenizer"):
        without_tokenizer.add_request("a", prompt("x"), constrained(choice=["a"]))
    without_eos = EngineCore(runner, EngineConfig(num_blocks=16, block_size=8), tokenizer=ByteTokenizer())
    with pytest.raises(InvalidArgumentError, match="end-of-sequence"):
        without_eos.add_request("a", prompt("x"), constrained(choice=["a"]))
    assert not without_tokenizer.has_unfinished() and not without_eos.has_unfinished()


def test_constrained_samples_survive_preemption_and_stay_valid(weights):
    """A pool too small for every sequence preempts some mid-output; their matchers, kept per
    sample, continue where the kept tokens left them."""
    core = make_core(weights, num_blocks=24, block_size=4, max_num_seqs=6, admission_lookahead_tokens=None)
    requests = {f"r{i}": (prompt("record: "), constrained(json=SCHEMA, max_tokens=160, seed=i))
                for i in range(6)}
    outputs = run(core, requests)
    assert core.stats()["preemptions"] > 0, "the configuration was meant to preempt"
    for output in outputs.values():
        completion = output.outputs[0]
        assert completion.finish_reason == "stop" and output.error is None
        jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_aborting_a_constrained_request_mid_output_leaves_the_others_valid(weights):
    core = make_core(weights)
    for i in range(3):
        core.add_request(f"r{i}", prompt("p"), constrained(json=SCHEMA, max_tokens=200, seed=i))
    for _ in range(5):
        core.step()
    assert core.abort("r1").outputs[0].finish_reason == "abort"
    outputs = run(core, {})
    assert set(outputs) == {"r0", "r2"}
    for output in outputs.values():
        jsonschema.validate(json.loads(output.outputs[0].text), SCHEMA)


def test_the_simulated_runner_keeps_to_the_mask():
    """The simulated model picks tokens without logits; a constrained row takes the lowest token
    its grammar allows when its own is not."""
    model = SimulatedModel(vocab_size=300, stop_token_ids=())
    core = EngineCore(SimulatedRunner(model, VirtualClock()), EngineConfig(num_blocks=64, block_size=8),
                      eos_token_ids=[EOS], tokenizer=ByteTokenizer())
    free = SamplingParams(max_tokens=4)
    outputs = run(core, {"digits": (prompt("x"), constrained(regex="[0-9]{4}")), "free": (prompt("x"), free)})
    assert re.fullmatch("[0-9]{4}", outputs["digits"].outputs[0].text)
    assert outputs["digits"].outputs[0].finish_reason == "stop"


def test_samples_certain_takes_the_lowest_allowed_token_and_refuses_a_failed_grammar():
    params = [SamplingParams()] * 3
    allowed = np.zeros((2, 300), dtype=bool)
    allowed[0, [40, 50]] = True
    masks = RowMasks.from_bools({0: allowed[0], 2: allowed[1]}, rows=3, vocab=300)
    masks = RowMasks(masks.words, masks.rows, {2: "the grammar failed: boom"})
    samples = Samples.certain(np.array([7, 8, 9]), params, masks)
    assert samples.tokens.tolist() == [40, 8, -1]
    assert samples.refused == {2: "the grammar failed: boom"}


def test_the_grammar_cache_compiles_each_distinct_constraint_once_and_stays_bounded():
    compiler = GrammarCompiler(ByteTokenizer(), 300, [EOS], capacity=2)
    same = [StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
            StructuredOutputs(json='{ "type": "object",\n  "properties": {"a": {"type": "integer"}} }')]
    assert compiler.compile(same[0]) is compiler.compile(same[1])  # one schema, spaced two ways
    compiler.compile(StructuredOutputs(regex="a+"))
    compiler.compile(StructuredOutputs(choice=["x", "y"]))
    assert len(compiler) == 2
    stats = compiler.stats()
    assert stats["grammar_compiles"] == 3 and stats["grammar_cache_hits"] == 1
    with pytest.raises(InvalidArgumentError, match="capacity"):
        GrammarCompiler(ByteTokenizer(), 300, [EOS], capacity=0)


@pytest.mark.parametrize("bad", [
    {}, {"json": SCHEMA, "regex": "a"}, {"json_object": True, "choice": ["a"]}, {"choice": []}, {"choice": "ab"},
    {"regex": ""}, {"json": "{not json"}, {"json": [1, 2]}, {"json": "x" * 200_000}, {"json_object": 1},
    {"json": '{"a":' * 5000 + "1" + "}" * 5000}, {"json": {"nan": float("nan")}},
    {"regex": "a", "continued_from": (1, -2)}, {"regex": "a", "continued_from": [True]},
])
def test_structured_outputs_refuse_values_asking_for_none_or_two_or_malformed(bad):
    with pytest.raises(InvalidArgumentError):
        StructuredOutputs(**bad)
    with pytest.raises(InvalidArgumentError):
        SamplingParams(structured_outputs=bad)  # not a StructuredOutputs at all


def metric(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(f"pagedkv:{name}_total{{"))
    return float(line.rsplit(" ", 1)[1])


def test_prometheus_counts_compiles_rejections_and_masks_read_when_scraped():
    """Read from the engine's stats at each scrape: a constraint refused while the engine idles
    is counted before any step runs."""
    with Engine.from_pretrained("tiny") as engine:
        with pytest.raises(InvalidArgumentError):
            engine.submit("x", constrained(regex="(unclosed"))
        assert metric(engine.metrics.text(), "grammar_rejected") == 1
        engine.generate(["a", "b"], constrained(regex="[a-z]{3}"))
        text = engine.metrics.text()
    assert metric(text, "grammar_compiles") == 1 and metric(text, "grammar_cache_hits") == 1
    assert metric(text, "grammar_mask_rows") >= 2 * 3  # three letters each, two requests
    assert metric(text, "grammar_mask_seconds") > 0 and metric(text, "grammar_compile_seconds") > 0


def test_a_migrated_sample_continues_its_grammar_past_the_tokens_it_carries(weights):
    """A replica's loss resubmits a sample as prompt + its tokens so far (``continuation``): its
    matcher starts past them, so the whole output still matches; a carried token the grammar
    refuses refuses the request."""
    params = constrained(json=SCHEMA, max_tokens=200, seed=5)
    whole = run(make_core(weights), {"r": (prompt("p"), params)})["r"].outputs[0]
    cut = len(whole.token_ids) // 2
    carried_prompt, carried = continuation(prompt("p"), params, whole.token_ids[:cut])
    assert carried.structured_outputs.continued_from == tuple(whole.token_ids[:cut])
    assert carried.structured_outputs.key == params.structured_outputs.key  # the same compiled grammar
    rest = run(make_core(weights), {"r": (carried_prompt, carried)})["r"].outputs[0]
    assert rest.finish_reason == "stop"
    jsonschema.validate(json.loads(ByteTokenizer().decode(whole.token_ids[:cut] + rest.token_ids)), SCHEMA)
    core = make_core(weights)
    refused = dataclasses.replace(carried, structured_outputs=dataclasses.replace(
        carried.structured_outputs, continued_from=tuple(prompt("not json"))[1:]))
    with pytest.raises(InvalidArgumentError, match="does not continue"):
        core.add_request("bad", carried_prompt, refused)
    assert not core.has_unfinished()


class CountingTokenizer(ByteTokenizer):
    """Counts how often the grammar compiler asks for the vocabulary's bytes."""

    spelled = 0

    def token_bytes(self):
        self.spelled += 1
        return super().token_bytes()


def test_the_vocabulary_built_in_the_background_is_the_one_compiles_use():
    tokenizer = CountingTokenizer()
    compiler = GrammarCompiler(tokenizer, 300, [EOS])
    thread = compiler.prepare_in_background()
    thread.join(timeout=120)
    assert not thread.is_alive() and tokenizer.spelled == 1
    compiler.compile(StructuredOutputs(regex="a+"))
    assert tokenizer.spelled == 1
    # Without a tokenizer the thread builds nothing and raises nothing; compiling says why.
    silent = GrammarCompiler(None, 300, [EOS])
    silent.prepare_in_background().join(timeout=120)
    with pytest.raises(InvalidArgumentError, match="tokenizer"):
        silent.compile(StructuredOutputs(regex="a+"))
