"""Structured outputs through the real SmolLM2-135M engine (issue 22's validity measure): every JSON
schema of ``tests/data/json_schemas.json`` generated greedy and sampled (temperature 1, seeded)
ends with "stop" and validates; an unconstrained request beside constrained ones gets the tokens
and logprobs it gets alone; ``n`` samples each validate; a schema llguidance refuses is a typed
error that leaves the engine serving; choice, regex and Lark constraints hold on the real model.

Invariants of the suite:

- The corpus holds at least 55 distinct schemas of different shapes (see its names), each valid
  under the 2020-12 metaschema. Its strings, arrays, numbers and recursions are bounded (or, for
  the linked list, primed by an example in the prompt) so that a 135M model can finish them;
  llguidance applies ``maxLength`` together with a ``format``.
- Every request of a run is added to one :class:`EngineCore` before its first step, so the
  batches, and with them every output, are the same on every run and machine: no test depends
  on timing.
- Validation is jsonschema's, with two fixes of its own false negatives: ``multipleOf`` compared on
  the number's decimal text (as a float, -1.2322 / 0.0001 is not whole) and checkers for the
  formats jsonschema checks only with optional packages (date-time, time, hostname, uri).
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterator
from datetime import date
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator, FormatChecker, ValidationError, validators

from pagedkv import Engine, InvalidArgumentError
from pagedkv.engine import EngineConfig, EngineCore, PagedModelRunner, RequestOutput
from pagedkv.grammar import StructuredOutputs
from pagedkv.loaders import load_model
from pagedkv.models import PagedDecoder
from pagedkv.sampling import SamplingParams
from pagedkv.text.tokenizer import Tokenizer

CORPUS: list[dict[str, Any]] = json.loads((Path(__file__).parents[1] / "data" / "json_schemas.json").read_text())
SCHEMAS: dict[str, dict[str, Any]] = {entry["name"]: entry for entry in CORPUS}
MODES = ("greedy", "sampled")
# Generous: the longest output of the corpus (the invoice) takes about 260 tokens.
MAX_TOKENS = 512


def _exact_multiple_of(validator: Any, divisor: float, instance: Any, schema: dict) -> Iterator[ValidationError]:
    """``multipleOf`` on the decimal text of the number (what the output wrote), not its float."""
    if validator.is_type(instance, "number") and Decimal(repr(instance)) % Decimal(repr(divisor)) != 0:
        yield ValidationError(f"{instance!r} is not a multiple of {divisor}")


_FORMATS = FormatChecker(list(Draft202012Validator.FORMAT_CHECKER.checkers))
# RFC 3339's full-time ("T" and "Z" may be lower case; a leap second may be 60): llguidance's
# "time" requires the offset.
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _is_date(text: str) -> bool:
    try:
        return bool(re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", text) and date.fromisoformat(text))
    except ValueError:
        return False


@_FORMATS.checks("date-time")
def _is_date_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    return _is_date(value[:10]) and value[10:11] in ("T", "t") and bool(re.fullmatch(_TIME, value[11:]))


@_FORMATS.checks("time")
def _is_time(value: object) -> bool:
    return not isinstance(value, str) or bool(re.fullmatch(_TIME, value))


@_FORMATS.checks("hostname")
def _is_hostname(value: object) -> bool:  # RFC 1123
    return not isinstance(value, str) or (len(value) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in value.split(".")))


@_FORMATS.checks("uri")
def _is_uri(value: object) -> bool:  # RFC 3986: a scheme, then no whitespace
    return not isinstance(value, str) or bool(re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*:\S*", value))


_Validator = validators.extend(Draft202012Validator, {"multipleOf": _exact_multiple_of})


def validate(text: str, schema: dict) -> None:
    """Raises unless ``text`` is one JSON value valid under ``schema``."""
    _Validator(schema, format_checker=_FORMATS).validate(json.loads(text))


@pytest.fixture(scope="module")
def smollm2() -> tuple[PagedDecoder, Tokenizer]:
    return load_model("smollm2-135m", weight_dtype="auto")


def make_core(smollm2: tuple[PagedDecoder, Tokenizer], max_num_seqs: int = 16) -> EngineCore:
    model, tokenizer = smollm2
    config = EngineConfig(max_num_seqs=max_num_seqs)
    return EngineCore(PagedModelRunner(model), config, eos_token_ids=model.config.eos_token_ids, tokenizer=tokenizer)


def run(core: EngineCore, tokenizer: Tokenizer, requests: dict[str, tuple[str, SamplingParams]]) -> dict[str, RequestOutput]:
    """Adds every request before the first step (the same batches on every run), then steps until
    they have all ended."""
    for request_id, (prompt, params) in requests.items():
        core.add_request(request_id, tokenizer.encode(prompt), params, prompt=prompt)
    outputs: dict[str, RequestOutput] = {}
    for _ in range(MAX_TOKENS + 64):  # prompts take a step or two; then a token per step
        _, ended = core.step()
        outputs.update((output.request_id, output) for output in ended)
        if not core.has_unfinished():
            return outputs
    raise AssertionError(f"still running after {MAX_TOKENS + 64} steps")


def corpus_params(name: str, mode: str, **overrides: Any) -> SamplingParams:
    sampling: dict[str, Any] = dict(max_tokens=MAX_TOKENS, temperature=0.0) if mode == "greedy" else dict(
        max_tokens=MAX_TOKENS, temperature=1.0, seed=1
    )
    return SamplingParams(structured_outputs=StructuredOutputs(json=SCHEMAS[name]["schema"]), **(sampling | overrides))


@pytest.fixture(scope="module")
def corpus_run(smollm2) -> tuple[dict[str, RequestOutput], dict[str, float]]:
    """Every schema, greedy and sampled, in one engine at once: the outputs by "mode/name", and
    the engine's stats."""
    core = make_core(smollm2, max_num_seqs=len(MODES) * len(CORPUS))
    requests = {f"{mode}/{name}": (SCHEMAS[name]["prompt"], corpus_params(name, mode)) for name in SCHEMAS for mode in MODES}
    outputs = run(core, smollm2[1], requests)
    return outputs, core.stats()


def test_the_corpus_holds_at_least_55_distinct_valid_schemas() -> None:
    assert len(SCHEMAS) == len(CORPUS) >= 55, "names must be distinct"
    assert len({StructuredOutputs(json=entry["schema"]).key for entry in CORPUS}) == len(CORPUS)
    for entry in CORPUS:
        Draft202012Validator.check_schema(entry["schema"])
        assert entry["prompt"].strip(), entry["name"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_corpus_output_stops_and_validates(corpus_run, name: str, mode: str) -> None:
    outputs, _ = corpus_run
    output = outputs[f"{mode}/{name}"]
    completion = output.outputs[0]
    assert output.error is None
    assert completion.finish_reason == "stop", f"ran to its limit: {completion.text[:200]!r}"
    validate(completion.text, SCHEMAS[name]["schema"])


def test_the_corpus_run_compiles_each_schema_once_and_samples_differ_from_greedy(corpus_run) -> None:
    outputs, stats = corpus_run
    assert stats["grammar_compiles"] == len(CORPUS) and stats["grammar_cache_hits"] == len(CORPUS)
    assert stats["grammar_rejected"] == 0
    assert stats["grammar_mask_rows"] >= sum(len(o.outputs[0].token_ids) for o in outputs.values())
    differing = [name for name in SCHEMAS if outputs[f"greedy/{name}"].text != outputs[f"sampled/{name}"].text]
    assert len(differing) > len(CORPUS) // 2, "the sampled half is mostly greedy again: is the temperature applied?"


@pytest.mark.parametrize("plain", [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3),
    SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True, logprobs=True, top_logprobs=3),
], ids=["greedy", "sampled"])
def test_an_unconstrained_request_beside_constrained_ones_gets_the_tokens_it_gets_alone(smollm2, plain) -> None:
    prompt = "The capital of France is"
    alone = run(make_core(smollm2), smollm2[1], {"plain": (prompt, plain)})["plain"].outputs[0]
    # The constrained requests run past the plain one's 24 tokens (their outputs are longer) and
    # are cut there: what they end with does not matter here.
    beside = run(make_core(smollm2), smollm2[1], {
        "invoice": (SCHEMAS["invoice"]["prompt"], corpus_params("invoice", "greedy", max_tokens=32)),
        "plain": (prompt, plain),
        "event": (SCHEMAS["calendar_event"]["prompt"], corpus_params("calendar_event", "sampled", max_tokens=32)),
        "choice": ("Yes or no? ", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(choice=["yes", "no"]))),
    })["plain"].outputs[0]
    assert beside.token_ids == alone.token_ids
    assert beside.logprobs == alone.logprobs


@pytest.mark.parametrize("name", ["invoice", "nested_arrays_of_objects", "oneof_payment"])
def test_each_of_n_samples_validates(smollm2, name: str) -> None:
    params = corpus_params(name, "sampled", n=4, seed=9)
    output = run(make_core(smollm2), smollm2[1], {"n": (SCHEMAS[name]["prompt"], params)})["n"]
    assert len(output.outputs) == 4 and output.error is None
    for completion in output.outputs:
        assert completion.finish_reason == "stop", completion.text[:200]
        validate(completion.text, SCHEMAS[name]["schema"])
    assert len({c.text for c in output.outputs}) > 1, "four seeded samples, one text"


# Schemas llguidance 1.9 refuses, each with what its error names.
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "unique items": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    "if/then": ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
    "not": ({"not": {"type": "string"}}, "not"),
    "contains": ({"type": "array", "contains": {"const": 3}}, "contains"),
    "unknown format": ({"type": "string", "format": "credit-card"}, "Unknown format"),
    "look-around pattern": ({"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]{4,8}$"}, "look-around"),
    "overlapping oneOf": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    "remote $ref": ({"$ref": "https://example.com/schema.json"}, "example.com"),
    "empty language": ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength"),
}


def test_a_schema_that_does_not_compile_is_refused_by_submit_and_the_engine_serves_on(smollm2) -> None:
    model, tokenizer = smollm2
    with Engine(model, tokenizer, EngineConfig(max_num_seqs=4)) as engine:
        for label, (schema, named) in REFUSED.items():
            params = SamplingParams(max_tokens=32, structured_outputs=StructuredOutputs(json=schema))
            with pytest.raises(InvalidArgumentError, match=re.escape(named)):
                engine.submit("x", params, request_id="refused")
            assert not engine.core.has_unfinished(), label
        assert engine.stats()["grammar_rejected"] == len(REFUSED)
        served = engine.submit(SCHEMAS["person"]["prompt"], corpus_params("person", "greedy"), request_id="refused").result()
    assert served.outputs[0].finish_reason == "stop"
    validate(served.text, SCHEMAS["person"]["schema"])


DATE_REGEX = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
IPV4_REGEX = r"((25[0-5]|2[0-4][0-9]|1?[0-9]{1,2})\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]{1,2})"
SQL = 'start: "SELECT " column (", " column){0,2} " FROM " table\ncolumn: "name" | "age" | "email"\ntable: "users" | "orders"\n'


@pytest.mark.parametrize("mode", MODES)
def test_choice_regex_lark_and_json_object_hold_on_the_real_model(smollm2, mode: str) -> None:
    sampling: dict[str, Any] = dict(temperature=0.0) if mode == "greedy" else dict(temperature=1.0, seed=3)

    def params(**kind: Any) -> SamplingParams:
        return SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputs(**kind), **sampling)

    outputs = run(make_core(smollm2), smollm2[1], {
        "choice": ("Review: 'I loved it.' Sentiment: ", params(choice=["positive", "negative", "neutral"])),
        "date": ("The first moon landing happened on ", params(regex=DATE_REGEX)),
        "ip": ("Google's DNS server is at ", params(regex=IPV4_REGEX)),
        "sql": ("A query listing user names: ", params(grammar=SQL)),
        "object": ("A JSON object describing a cat: ", params(json_object=True)),
    })
    assert all(output.error is None and output.outputs[0].finish_reason == "stop" for output in outputs.values()), {
        request_id: (output.outputs[0].finish_reason, output.text[:100]) for request_id, output in outputs.items()
    }
    assert outputs["choice"].text in {"positive", "negative", "neutral"}
    assert re.fullmatch(DATE_REGEX, outputs["date"].text)
    ipaddress.IPv4Address(outputs["ip"].text)
    assert re.fullmatch(r"SELECT (name|age|email)(, (name|age|email)){0,2} FROM (users|orders)", outputs["sql"].text)
    assert isinstance(json.loads(outputs["object"].text), dict)
