"""pagedkv._core.Vocabulary / Grammar / GrammarMatcher (issue 22's first part: the mask in the
core): the allowed tokens of small grammars against a brute force over the vocabulary, a JSON
schema's output validating, and bad grammars refused with a typed error."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedkv import InvalidArgumentError, ShapeError
from pagedkv._core import Grammar, Vocabulary

WORDS = [bytes([b]) for b in range(256)] + [b"ab", b"abc", b"yes", b"no", b"ma", b"aybe", b"</s>"]
EOS = len(WORDS) - 1
SPECIAL = [i == EOS for i in range(len(WORDS))]


@pytest.fixture(scope="module")
def vocabulary() -> Vocabulary:
    return Vocabulary(WORDS, SPECIAL, EOS)


def brute_force(output: bytes, language: list[str]) -> np.ndarray:
    members = [m.encode() for m in language]
    allowed = np.array([any(m.startswith(output + w) for m in members) for w in WORDS])
    allowed[EOS] = output in members
    return allowed


@pytest.mark.parametrize("spec, language", [
    (dict(choice=["yes", "no", "maybe"]), ["yes", "no", "maybe"]),
    (dict(regex="a(b|c){1,2}"), ["ab", "ac", "abb", "abc", "acb", "acc"]),
    (dict(lark='start: "n" ("o" | "ab")'), ["no", "nab"]),
])
@pytest.mark.parametrize("longest", [True, False])
def test_masks_equal_the_brute_force_at_every_step(vocabulary, spec, language, longest) -> None:
    matcher = Grammar(vocabulary, **spec).matcher()
    assert len(vocabulary) == len(WORDS)
    output = b""
    while True:
        allowed = matcher.allowed()
        np.testing.assert_array_equal(allowed, brute_force(output, language), err_msg=repr(output))
        choices = np.flatnonzero(allowed)
        token = int(choices[-1] if longest else choices[0])
        if token == EOS:
            break
        matcher.advance(token)
        output += WORDS[token]
    assert output.decode() in language and matcher.is_accepting


def test_a_json_schema_output_parses_and_validates(vocabulary) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    matcher = Grammar(vocabulary, json_schema=json.dumps(schema)).matcher()
    output = b""
    while not (allowed := matcher.allowed())[EOS]:
        first = int(np.flatnonzero(allowed)[0])
        matcher.advance(first)
        output += WORDS[first]
    # One line, items and keys separated as Python's json.dumps does: the whitespace is fixed.
    assert output == b'{"n": 1}'


@pytest.mark.parametrize("spec", [
    dict(json_schema="{not json"), dict(json_schema='{"type": "no such type"}'), dict(regex="a("),
    dict(lark="start: undefined_rule"), dict(choice=[]),
    dict(json_schema='{"type": "string", "minLength": 2, "maxLength": 1}'),  # matches nothing
])
def test_a_bad_grammar_is_a_typed_error(vocabulary, spec) -> None:
    with pytest.raises(InvalidArgumentError):
        Grammar(vocabulary, **spec)


def test_bad_arguments_and_tokens_change_nothing(vocabulary) -> None:
    with pytest.raises(TypeError, match="exactly one"):
        Grammar(vocabulary)
    with pytest.raises(TypeError, match="exactly one"):
        Grammar(vocabulary, regex="a", choice=["a"])
    with pytest.raises(InvalidArgumentError):
        Vocabulary([b"a"], [False], 1)
    matcher = Grammar(vocabulary, regex="ab").matcher()
    before = matcher.allowed()
    for token in (ord("z"), EOS + 1, EOS):
        with pytest.raises((InvalidArgumentError, OverflowError)):
            matcher.advance(token)
    with pytest.raises((InvalidArgumentError, OverflowError)):
        matcher.advance(-1)
    np.testing.assert_array_equal(matcher.allowed(), before)
    matcher.advance(ord("a"))
    matcher.advance(ord("b"))
    assert matcher.is_accepting and np.flatnonzero(matcher.allowed()).tolist() == [EOS]


TEXTS = ["Hello, world!", "naïve café — ünïcödé 👋🏽 日本語", "  two spaces\tand\ttabs\n{\"json\": [1, 2.5e-3, null]}"]


@pytest.fixture(scope="module", params=["tiny", "smollm2-135m", "gemma3-270m"])
def tokenizer(request):
    from pagedkv.loaders import load_model
    from pagedkv.text import ByteTokenizer

    return ByteTokenizer() if request.param == "tiny" else load_model(request.param, weight_dtype="auto")[1]


def test_a_tokenizers_token_bytes_spell_every_text_it_encodes(tokenizer) -> None:
    words, special = tokenizer.token_bytes()
    assert len(words) == len(special) == tokenizer.vocab_size
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(words[t] for t in ids) == text.encode(), text
        assert not any(special[t] for t in ids)


def test_a_choice_on_a_real_vocabulary_allows_exactly_the_prefixes(tokenizer) -> None:
    words, special = tokenizer.token_bytes()
    eos = next(t for t, s in enumerate(special) if s)
    matcher = Grammar(Vocabulary(words, special, eos), choice=["yes", "no"]).matcher()
    allowed = np.flatnonzero(matcher.allowed())
    assert allowed.size > 0
    assert all(not special[t] and any(c.startswith(words[t]) for c in (b"yes", b"no")) for t in allowed)
    assert {words[t] for t in allowed} >= {b"y", b"n"}


def test_a_grammars_mask_constrains_its_row_and_leaves_the_batch_beside_it_alone(vocabulary) -> None:
    """The sampler applies the mask before everything else: a constrained row sampled beside an
    unconstrained one changes nothing for the latter (tokens and logprobs as sampled alone)."""
    from pagedkv.sampling import SamplingParams, sample_with_logprobs

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, len(WORDS))).astype(np.float32) * 3
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, logprobs=True, top_logprobs=3) for s in (1, 2)]
    matcher = Grammar(vocabulary, choice=["yes", "no", "maybe"]).matcher()
    output = b""
    for _ in range(8):
        mask = matcher.allowed()
        gens = [p.make_generator(len(output)) for p in params]
        both = sample_with_logprobs(logits, params, gens, masks={0: mask})
        alone = sample_with_logprobs(logits[1:], params[1:], [params[1].make_generator(len(output))])
        assert both.tokens[1] == alone.tokens[0] and both.logprobs[1] == alone.logprobs[0]
        np.testing.assert_array_equal(both.top_ids[1], alone.top_ids[0])
        token = int(both.tokens[0])
        assert mask[token] and set(both.top_ids[0][both.top_ids[0] >= 0]) <= set(np.flatnonzero(mask))
        if token == EOS:
            break
        matcher.advance(token)
        output += WORDS[token]
    assert output.decode() in ("yes", "no", "maybe")
    with pytest.raises(ShapeError):
        sample_with_logprobs(logits, params, gens, masks={0: mask[:-1]})
    with pytest.raises(ShapeError):
        sample_with_logprobs(logits, params, gens, masks={2: mask})


def test_a_prepared_json_schema_is_what_a_json_schema_constraint_compiles(vocabulary) -> None:
    """What a tool call's ``%json`` embeds: objects closed, one line, unless ``x-guidance`` says."""
    from pagedkv._core import prepared_json_schema

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}}}
    prepared = json.loads(prepared_json_schema(json.dumps(schema)))
    assert prepared["additionalProperties"] is False and prepared["properties"]["a"]["additionalProperties"] is False
    assert prepared["x-guidance"] == {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    own = {**schema, "x-guidance": {"whitespace_flexible": True}, "additionalProperties": True}
    assert json.loads(prepared_json_schema(json.dumps(own)))["x-guidance"] == {"whitespace_flexible": True}
    with pytest.raises(InvalidArgumentError, match="not JSON"):
        prepared_json_schema("{not json")
    # The same output through a Lark grammar's %json as through the schema itself.
    lark = Grammar(vocabulary, lark=f"start: %json {prepared_json_schema(json.dumps(schema))}").matcher()
    direct = Grammar(vocabulary, json_schema=json.dumps(schema)).matcher()
    for byte in b'{"a": {"b": 1}}':
        assert (lark.allowed() == direct.allowed()).all()
        lark.advance(byte)
        direct.advance(byte)
