"""Issue 22 on ``/v1/responses`` through `pagedkv serve` on 127.0.0.1 (the tiny random model)
with the official openai SDK: ``text.format`` (``.parse(text_format=…)``, ``json_object``),
function tools (``required``, a named function, ``auto``), a streamed call the SDK reassembles,
history with ``function_call`` / ``function_call_output`` items rendered as chat renders them,
and every bad request a 400 naming its field. The model writes noise: every assertion is that
the constrained output is valid anyway."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from served import MODEL, City

from pagedkv.server.tools import TOOL_CALL_OPEN

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 14}},
           "required": ["city", "days"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 10},
                                           "exact": {"type": "boolean"}}, "required": ["query"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The forecast.", "parameters": WEATHER, "strict": True},
         {"type": "function", "name": "search", "parameters": SEARCH, "strict": False}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
QUESTION = "Weather in Oslo?"


def calls_of(response) -> list:
    """The function_call items of ``response``, each well formed, of a tool offered, its
    arguments valid under that function's schema."""
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls, response.output
    for call in calls:
        assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.name in SCHEMAS
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


# ---- text.format ----------------------------------------------------------------------------------


def test_parse_returns_the_pydantic_object(client):
    for seed in range(3):
        response = client.responses.parse(model=MODEL, input="Describe a city.", text_format=City, max_output_tokens=200,
                                          temperature=1.0, extra_body={"seed": seed})
        assert response.status == "completed", response
        assert isinstance(response.output_parsed, City), response.output_text
        assert response.output_parsed == City.model_validate_json(response.output_text)
        assert response.text.format.type == "json_schema" and response.text.format.name == "City"


def test_parse_streamed_returns_the_pydantic_object(client):
    with client.responses.stream(model=MODEL, input="Describe a city.", text_format=City, max_output_tokens=200,
                                 temperature=1.0, extra_body={"seed": 5}) as stream:
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, City), final.output_text


def test_json_schema_json_object_and_text_formats(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}}, "required": ["ok"]}
    form = {"type": "json_schema", "name": "answer", "schema": schema, "strict": False}  # enforced all the same
    for seed in range(3):
        response = client.responses.create(model=MODEL, input="Answer.", text={"format": form}, max_output_tokens=200,
                                           temperature=1.0, extra_body={"seed": seed})
        assert response.status == "completed"
        jsonschema.validate(json.loads(response.output_text), schema)
    # Any object: noise may run past max_output_tokens inside its strings; what ends is an object.
    for seed in range(3):
        response = client.responses.create(model=MODEL, input="Answer.", text={"format": {"type": "json_object"}},
                                           max_output_tokens=200, temperature=0.8, extra_body={"seed": seed})
        assert response.output_text.startswith("{")
        assert response.status == "incomplete" or isinstance(json.loads(response.output_text), dict)
    plain = client.responses.create(model=MODEL, input="hello", text={"format": {"type": "text"}}, max_output_tokens=5,
                                    temperature=0)
    assert [item.type for item in plain.output] == ["message"] and plain.text.format.type == "text"


# ---- tools ----------------------------------------------------------------------------------------


def test_required_calls_validate_against_their_functions(client):
    for parallel in (False, True):
        for seed in range(3):
            response = client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=parallel, max_output_tokens=400, temperature=1.0,
                                               extra_body={"seed": seed})
            assert response.status == "completed" and all(item.type == "function_call" for item in response.output)
            calls = calls_of(response)
            assert all(call.status == "completed" for call in calls) and (parallel or len(calls) == 1)
            assert response.tool_choice == "required" and response.parallel_tool_calls is parallel
            assert [tool.name for tool in response.tools] == ["get_weather", "search"]


def test_a_named_function_is_the_one_called(client):
    for seed in range(3):
        response = client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS, max_output_tokens=400,
                                           tool_choice={"type": "function", "name": "search"}, temperature=1.0,
                                           extra_body={"seed": seed})
        (call,) = calls_of(response)
        assert call.name == "search"


def test_auto_answers_text_or_valid_calls(client):
    for seed in range(4):
        response = client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS, max_output_tokens=200,
                                           temperature=1.0, extra_body={"seed": seed})
        messages = [item for item in response.output if item.type == "message"]
        assert len(messages) <= 1 and (not messages or response.output[0] is messages[0])  # text comes first
        assert TOOL_CALL_OPEN not in response.output_text
        if response.status == "completed" and len(messages) < len(response.output):
            calls_of(response)


def test_a_call_cut_by_max_output_tokens_is_incomplete(client):
    # 60 tokens (bytes) end any call inside its arguments: its opening alone is 45 or more.
    response = client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS, tool_choice="required",
                                       max_output_tokens=60, temperature=1.0, extra_body={"seed": 2})
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    (call,) = response.output
    assert call.type == "function_call" and call.status == "incomplete" and call.name in SCHEMAS


def test_a_streamed_call_is_reassembled_by_the_sdk(client):
    body = {"model": MODEL, "input": QUESTION, "tools": TOOLS, "tool_choice": "required", "max_output_tokens": 400,
            "temperature": 1.0, "extra_body": {"seed": 6}}
    whole = client.responses.create(**body)
    with client.responses.stream(**body) as stream:
        final = stream.get_final_response()
    said = [(c.name, c.arguments) for c in calls_of(final)]
    assert said == [(c.name, c.arguments) for c in calls_of(whole)]
    # The events themselves: numbered from 0; each call added with empty arguments, its deltas,
    # its arguments done, the item done, at the output_index it has in the final output.
    events = list(client.responses.create(stream=True, **body))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed"
    final_output = events[-1].response.output
    for index, item in enumerate(final_output):
        mine = [e for e in events if getattr(e, "output_index", None) == index]
        kinds = [e.type for e in mine]
        assert kinds[0] == "response.output_item.added" and kinds[-2:] == [
            "response.function_call_arguments.done", "response.output_item.done"]
        assert set(kinds[1:-2]) <= {"response.function_call_arguments.delta"}
        assert mine[0].item.arguments == "" and mine[0].item.status == "in_progress"
        assert mine[0].item.call_id == item.call_id and mine[0].item.id == item.id
        assert "".join(e.delta for e in mine[1:-2]) == mine[-2].arguments == item.arguments
        assert all(e.item_id == item.id for e in mine[1:-1])
        assert mine[-1].item.status == "completed" and mine[-1].item.arguments == item.arguments
    assert [(c.name, c.arguments) for c in final_output] == said


def test_none_offers_nothing_and_calls_nothing(client):
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 8, "temperature": 0}
    response = client.responses.create(tools=TOOLS, tool_choice="none", **body)
    assert [item.type for item in response.output] == ["message"]
    assert response.usage.input_tokens == client.responses.create(**body).usage.input_tokens  # functions not shown


def chat_prompt_tokens(server, messages: list[dict]) -> int:
    """The prompt tokens of ``messages`` offered :data:`TOOLS` over chat."""
    tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": messages, "tools": tools, "max_tokens": 1})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


def test_history_with_calls_and_results_is_rendered_as_chat_renders_it(client, server):
    body = {"model": MODEL, "tools": TOOLS, "max_output_tokens": 400, "temperature": 1.0, "extra_body": {"seed": 1}}
    first = client.responses.create(input=QUESTION, tool_choice={"type": "function", "name": "get_weather"}, **body)
    (call,) = calls_of(first)
    # The SDK's pattern: the output items sent back as they came, then the result.
    history = [{"role": "user", "content": QUESTION}, *first.output,
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    second = client.responses.create(input=history, tool_choice="required", instructions="Be brief.", **body)
    calls_of(second)
    past_call = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    assert second.usage.input_tokens == chat_prompt_tokens(server, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [past_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}])
    # Text then calls: one assistant turn; a result given as text parts: their text.
    arguments = '{"city": "Oslo", "days": 1}'
    parts = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": arguments},
             {"type": "function_call", "call_id": "c2", "name": "search", "arguments": '{"query": "Oslo"}'},
             {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "sunny"}]},
             {"type": "function_call_output", "call_id": "c2", "output": "a city"}]
    third = client.responses.create(input=parts, tool_choice="required", **body)
    calls_of(third)
    assert third.usage.input_tokens == chat_prompt_tokens(server, [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}},
            {"id": "c2", "type": "function", "function": {"name": "search", "arguments": '{"query": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "tool", "tool_call_id": "c2", "content": "a city"}])


BAD = [
    ({"tool_choice": {"type": "function", "name": "missing"}}, "tool_choice", "missing"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].name", "two functions"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name", "letters"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, "tools[0].parameters", "object"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "minLength": 5, "maxLength": 2}}, "required": ["a"]}}], "tool_choice": "required"},
     "tools", "minLength"),
    ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools.0", ""),  # chat's nested shape
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", ""),
    ({"tools": None, "text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "string", "minLength": 5, "maxLength": 2}}}}, "text.format", "minLength"),
    ({"tools": None, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "needs schema"),
    ({"tools": None, "text": {"format": {"type": "regex"}}}, "text.format", ""),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                    "arguments": "{not json"}]}, "input[1].arguments", "JSON"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.function_call_output.call_id", ""),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0", "reasoning"),
]


@pytest.mark.parametrize("fields, param, message", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_a_bad_request_is_a_400_naming_its_field(server, fields, param, message):
    body = {"model": MODEL, "input": QUESTION, "tools": TOOLS, "max_output_tokens": 5, **fields}
    response = httpx.post(f"{server.url}/v1/responses", json={k: v for k, v in body.items() if v is not None}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith(param) and message in error["message"], error
    server.wait_idle()
