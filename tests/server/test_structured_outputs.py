"""Issue 22 through `pagedkv serve` on 127.0.0.1 (the tiny random model): ``response_format``
(``json_object``, ``json_schema``), vLLM's ``structured_outputs`` and its legacy ``guided_*``
aliases, on chat and completions, whole and streamed, with the official openai SDK's ``.parse()``
and LangChain's ``with_structured_output``. The model writes noise: every assertion is that the
constrained output is valid anyway. Bad constraints are 400s naming their field, queue nothing,
and leave a concurrent request untouched."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest
from served import MODEL, City, Server

from pagedkv.grammar import MAX_GRAMMAR_CHARS

USER = [{"role": "user", "content": "Describe a city."}]


CITY_SCHEMA = City.model_json_schema()


def chat(server: Server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": USER, **body}, timeout=60)


def contents(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert all(c["finish_reason"] == "stop" for c in choices), choices  # the grammar ended every one
    return [c["message"]["content"] if "message" in c else c["text"] for c in choices]


# ---- the clients ----------------------------------------------------------------------------------


def test_the_openai_sdk_parse_returns_the_pydantic_object(client):
    for seed in range(4):
        completion = client.chat.completions.parse(model=MODEL, messages=USER, response_format=City, max_tokens=200,
                                                   temperature=1.0, seed=seed)
        message = completion.choices[0].message
        assert isinstance(message.parsed, City), message.content
        assert message.parsed == City.model_validate_json(message.content)


def test_langchain_with_structured_output_returns_the_pydantic_object(server):
    from langchain_openai import ChatOpenAI

    for seed in range(2):
        llm = ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="none", max_tokens=200, temperature=1.0,
                         seed=seed, max_retries=0)
        city = llm.with_structured_output(City).invoke("Describe a city.")
        assert isinstance(city, City)


# ---- every way of asking --------------------------------------------------------------------------


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}}},
    {"structured_outputs": {"json": CITY_SCHEMA}},
    {"guided_json": CITY_SCHEMA},
    {"guided_json": json.dumps(CITY_SCHEMA)},  # the schema as JSON text
], ids=["response_format", "structured_outputs", "guided_json", "guided_json_text"])
def test_a_json_schema_holds_every_sample_on_both_endpoints(server, fields):
    for answer in contents(chat(server, max_tokens=200, n=4, temperature=1.0, seed=7, **fields)):
        jsonschema.validate(json.loads(answer), CITY_SCHEMA)
    completions = httpx.post(f"{server.url}/v1/completions",
                             json={"model": MODEL, "prompt": "A city:", "max_tokens": 200, "n": 2, "seed": 3, **fields})
    for answer in contents(completions):
        jsonschema.validate(json.loads(answer), CITY_SCHEMA)


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_object"}}, {"structured_outputs": {"json_object": True}}, {"guided_json_object": True},
], ids=["response_format", "structured_outputs", "guided_json_object"])
def test_json_object_is_an_object(server, fields):
    for answer in contents(chat(server, max_tokens=300, n=3, temperature=0.8, seed=1, **fields)):
        assert isinstance(json.loads(answer), dict)


@pytest.mark.parametrize("fields, valid", [
    ({"guided_regex": r"[0-9]{3}-[a-z]{2,4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    ({"structured_outputs": {"regex": r"(yes|no), [A-Z][a-z]{0,6}\."}},
     lambda t: re.fullmatch(r"(yes|no), [A-Z][a-z]{0,6}\.", t)),
    ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"guided_grammar": 'start: "x=" NUMBER ";"\nNUMBER: /[0-9]{1,4}/'}, lambda t: re.fullmatch(r"x=[0-9]{1,4};", t)),
    ({"structured_outputs": {"grammar": 'start: "(" item ("," item)* ")"\nitem: "a" | "b"'}},
     lambda t: re.fullmatch(r"\([ab](,[ab])*\)", t)),
], ids=["guided_regex", "regex", "guided_choice", "choice", "guided_grammar", "grammar"])
def test_regex_choice_and_grammar_hold_every_sample(server, fields, valid):
    for answer in contents(chat(server, max_tokens=100, n=4, temperature=1.0, seed=11, **fields)):
        assert valid(answer), answer


def test_a_streamed_constrained_answer_says_what_the_whole_one_says(client):
    body = {"model": MODEL, "messages": USER, "max_tokens": 200, "temperature": 1.0, "seed": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}}}
    whole = client.chat.completions.create(**body)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(stream=True, **body)
                       if chunk.choices)
    assert streamed == whole.choices[0].message.content
    jsonschema.validate(json.loads(streamed), CITY_SCHEMA)


def test_whitespace_options_shape_the_json(server):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}
    (compact,) = contents(chat(server, max_tokens=50, guided_json=schema, structured_outputs=None,
                               guided_whitespace_pattern=r"[ ]{0,3}"))
    assert json.loads(compact)["a"] in range(10) and not re.search(r"[\n\t]", compact)
    (tight,) = contents(chat(server, max_tokens=50, structured_outputs={"json": schema, "disable_any_whitespace": True}))
    assert re.fullmatch(r'\{"a":[0-9]\}', tight)
    # A response_format of type text asks for nothing.
    assert chat(server, max_tokens=3, response_format={"type": "text"}).status_code == 200


# ---- bad input ------------------------------------------------------------------------------------


def huge_schema() -> dict:
    properties = {f"p{i}": {"type": "string", "description": "x" * 100} for i in range(MAX_GRAMMAR_CHARS // 100)}
    return {"type": "object", "properties": properties}


BAD = [
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, "guided_json", "compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format", "compile"),
    ({"guided_json": {"type": "string", "minLength": 5, "maxLength": 2}}, "guided_json", "minLength"),
    ({"structured_outputs": {"json": {"enum": []}}}, "structured_outputs", "compile"),
    ({"guided_regex": "[z-a]"}, "guided_regex", "compile"),
    ({"guided_grammar": "start: nothing_defined"}, "guided_grammar", "compile"),
    ({"guided_choice": []}, "guided_choice", "choice"),
    ({"guided_json": huge_schema()}, "guided_json", str(MAX_GRAMMAR_CHARS)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}, "guided_regex": "a"},
     "guided_regex", "response_format and guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "none of"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
    ({"response_format": {"type": "grammar"}}, "response_format", "type"),
    ({"guided_whitespace_pattern": " *", "guided_regex": "a"}, "guided_whitespace_pattern", "JSON"),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "JSON"),
]


@pytest.mark.parametrize("fields, param, message", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_a_bad_constraint_is_a_400_naming_its_field_and_queues_nothing(server, fields, param, message):
    response = chat(server, max_tokens=5, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith(param) and message in error["message"], error
    server.wait_idle()


def test_a_regex_bomb_compiles_in_bounded_time_and_holds(server):
    # (a|aa)*(b{1,1000}){1,1000}: llguidance builds its automaton lazily; the request is answered
    # (a 400 would do too), its text within the regex as far as it went.
    response = chat(server, max_tokens=40, temperature=1.0, seed=2, guided_regex="(a|aa)*(b{1,1000}){1,1000}")
    assert response.status_code in (200, 400), response.text
    if response.status_code == 200:
        (choice,) = response.json()["choices"]
        assert re.fullmatch(r"a*b*", choice["message"]["content"]), choice
        assert choice["finish_reason"] in ("stop", "length")
    server.wait_idle()


def test_bad_constraints_leave_a_concurrent_request_untouched(server):
    async def run() -> tuple[httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            plain = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 64,
                                                             "ignore_eos": True, "temperature": 0})
            bad = [http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 5, **fields})
                   for fields, _, _ in BAD]
            answers = await asyncio.gather(plain, *bad)
            return answers[0], list(answers[1:])

    plain, refused = asyncio.run(run())
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 64
    assert all(r.status_code == 400 for r in refused)
    alone = chat(server, max_tokens=64, ignore_eos=True, temperature=0)
    assert plain.json()["choices"][0]["message"]["content"] == alone.json()["choices"][0]["message"]["content"]
    server.wait_idle()
