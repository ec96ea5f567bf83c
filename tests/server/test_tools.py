"""Issue 22's tools: the call format's grammar and parser on the byte vocabulary (every text the
grammar allows parses; ``auto``'s text never begins a malformed call), the conversation as a
template sees it, then `pagedkv serve` on 127.0.0.1 (the tiny random model) with the openai SDK
and LangChain's ``bind_tools``: ``required`` and named calls whose arguments validate against
their function's schema, ``auto``, a streamed call the SDK reassembles, history with past calls,
and every bad request a 400."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, ConfigDict, Field
from served import MODEL, TEMPLATE

from pagedkv.grammar import GrammarCompiler, StructuredOutputs
from pagedkv.server.tools import (
    TOOL_CALL_OPEN,
    Function,
    ToolUse,
    call_text,
    prepare_conversation,
    tools_prompt,
)
from pagedkv.text.chat import render_chat, template_reads
from pagedkv.text.tokenizer import ByteTokenizer

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 14}},
           "required": ["city", "days"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 10},
                                           "exact": {"type": "boolean"}}, "required": ["query"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast.", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
FUNCTIONS = [Function.of(i, t["function"]["name"], t["function"].get("description"), t["function"]["parameters"])
             for i, t in enumerate(TOOLS)]
USER = [{"role": "user", "content": "Weather in Oslo?"}]


# ---- the format, without a server -----------------------------------------------------------------


@pytest.fixture(scope="module")
def grammars() -> GrammarCompiler:
    return GrammarCompiler(ByteTokenizer(), ByteTokenizer().vocab_size, [ByteTokenizer.EOS_ID])


def allowed(grammars: GrammarCompiler, use: ToolUse, text: str, answer: dict | None = None) -> bool:
    """Whether ``use``'s grammar takes ``text`` whole (the byte tokenizer: a token per byte)."""
    matcher = grammars.compile(StructuredOutputs(grammar=use.grammar(answer))).matcher()
    tokenizer = ByteTokenizer()
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.allowed()[token]:
            return False
        matcher.advance(token)
    return matcher.is_accepting


def parsed(use: ToolUse, text: str, piece: int) -> tuple[dict, list[dict]]:
    """The message and deltas of ``text`` fed ``piece`` characters at a time."""
    parser = use.parser()
    deltas = [d for i in range(0, len(text), piece) for d in parser.feed(text[i:i + piece])] + parser.finish()
    return parser.message(), deltas


PAST_CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]}
WEATHER_CALL = call_text("get_weather", json.dumps({"city": "Oslo", "days": 3}))
SEARCH_CALL = call_text("search", json.dumps({"query": 'a "q" {x}'}))


def test_each_choice_allows_what_it_says(grammars):
    auto = ToolUse.of(FUNCTIONS, None, None, parallel=True)
    required = ToolUse.of(FUNCTIONS, "required", None, parallel=True)
    single = ToolUse.of(FUNCTIONS, "required", None, parallel=False)
    named = ToolUse.of(FUNCTIONS, "auto", "search", parallel=True)
    both = f"{WEATHER_CALL}\n{SEARCH_CALL}"
    assert allowed(grammars, auto, "Just text, <tool_ no call.") and allowed(grammars, auto, "")
    assert allowed(grammars, auto, f"Let me look.\n{both}") and allowed(grammars, auto, WEATHER_CALL)
    assert not allowed(grammars, auto, f"text {TOOL_CALL_OPEN} and more text")  # an open tag begins a call
    assert not allowed(grammars, auto, WEATHER_CALL + " trailing text")
    assert not allowed(grammars, auto, call_text("get_weather", json.dumps({"city": "Rome", "days": 3})))
    assert not allowed(grammars, auto, call_text("delete_all", "{}"))
    assert allowed(grammars, required, both) and not allowed(grammars, required, "text")
    assert allowed(grammars, single, WEATHER_CALL) and not allowed(grammars, single, both)
    assert allowed(grammars, named, SEARCH_CALL) and not allowed(grammars, named, WEATHER_CALL)
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    assert allowed(grammars, auto, '{"ok": true}', answer) and allowed(grammars, auto, WEATHER_CALL, answer)
    assert not allowed(grammars, auto, "free text", answer)
    assert not allowed(grammars, auto, '{"ok": true, "extra": 1}', answer)  # objects closed, as the core's


def test_the_parser_reads_calls_and_text_alike_in_any_pieces():
    auto = ToolUse.of(FUNCTIONS, "auto", None, parallel=True)
    text = f"Let me look.  \n{WEATHER_CALL}\n{SEARCH_CALL}"
    for piece in (1, 2, 5, len(text)):
        message, deltas = parsed(auto, text, piece)
        assert message["content"] == "Let me look."
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
            ("get_weather", {"city": "Oslo", "days": 3}), ("search", {"query": 'a "q" {x}'})]
        openings = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
        assert [o["index"] for o in openings] == [0, 1] and all(o["function"]["arguments"] == "" for o in openings)
        assert "".join(d.get("content", "") for d in deltas) == "Let me look."
    for text in ("plain words <tool_c", "", "  spaced  "):
        message, _ = parsed(auto, text, 1)
        assert message == {"role": "assistant", "content": text}
    required = ToolUse.of(FUNCTIONS, "required", None, parallel=True)
    message, _ = parsed(required, WEATHER_CALL, 3)
    assert message["content"] is None and len(message["tool_calls"]) == 1
    cut, _ = parsed(required, WEATHER_CALL[:-20], 1)  # max_tokens inside the arguments: as far as they went
    arguments = cut["tool_calls"][0]["function"]["arguments"]
    assert arguments and '{"city": "Oslo", "days": 3}'.startswith(arguments) and arguments != '{"city": "Oslo", "days": 3}'
    cut, _ = parsed(required, WEATHER_CALL[:20], 1)  # before its name is whole: no call yet
    assert cut == {"role": "assistant", "content": None if cut.get("tool_calls") else ""}


def test_the_conversation_a_template_sees():
    history = [{"role": "system", "content": "Be brief."}, *USER, PAST_CALL,
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
               {"role": "tool", "tool_call_id": "c2", "content": "cold"}]
    assert not template_reads(TEMPLATE, "tools")
    messages, tools = prepare_conversation(history, FUNCTIONS, template_has_tools=False)
    assert tools is None and messages[0]["content"] == "Be brief.\n\n" + tools_prompt(FUNCTIONS)
    assert messages[2] == {"role": "assistant", "content": call_text("get_weather", '{"city": "Oslo", "days": 1}')}
    responses = "<tool_response>\nsunny\n</tool_response>\n<tool_response>\ncold\n</tool_response>"
    assert messages[3] == {"role": "user", "content": responses}
    assert len(messages) == 4
    aware = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}{% endfor %}"
    assert template_reads(aware, "tools")
    messages, tools = prepare_conversation(history, FUNCTIONS, template_has_tools=True)
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo", "days": 1}  # an object, as templates expect
    assert render_chat(aware, messages, tools=tools) == "[get_weather][search]systemuserassistanttooltool"


# ---- through the server ---------------------------------------------------------------------------


def check_calls(calls, names: set[str]) -> None:
    """Each call well formed, of one of ``names``, its arguments valid under its function's schema."""
    assert calls, "no tool call"
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_calls_validate_against_their_functions(client):
    for parallel in (False, True):
        completion = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                                    parallel_tool_calls=parallel, max_tokens=400, n=6, temperature=1.0, seed=4)
        for choice in completion.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            check_calls(choice.message.tool_calls, set(SCHEMAS))
            assert parallel or len(choice.message.tool_calls) == 1
        assert len({c.id for choice in completion.choices for c in choice.message.tool_calls}) == sum(
            len(choice.message.tool_calls) for choice in completion.choices)


def test_a_named_function_is_the_one_called(client):
    completion = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "search"}},
        max_tokens=400, n=4, temperature=1.0, seed=9)
    for choice in completion.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls, {"search"})


def test_auto_answers_text_or_valid_calls(client):
    completion = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=200, n=8,
                                                temperature=1.0, seed=1)
    for choice in completion.choices:
        if choice.finish_reason == "tool_calls":
            check_calls(choice.message.tool_calls, set(SCHEMAS))
        elif not choice.message.tool_calls:  # text: stopped, or cut by max_tokens
            assert TOOL_CALL_OPEN not in choice.message.content and choice.finish_reason in ("stop", "length")
        else:  # a call cut by max_tokens: those before it valid
            assert choice.finish_reason == "length"
            for call in choice.message.tool_calls[:-1]:
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_auto_with_a_response_format_answers_it_or_calls(client):
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    completion = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, max_tokens=300, n=6, temperature=1.0, seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": answer}})
    for choice in completion.choices:
        assert choice.finish_reason in ("stop", "tool_calls"), choice
        if choice.message.tool_calls:
            check_calls(choice.message.tool_calls, set(SCHEMAS))
        else:
            jsonschema.validate(json.loads(choice.message.content), answer)


def test_none_offers_nothing_and_calls_nothing(client):
    completion = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="none",
                                                max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    choice = completion.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.usage.prompt_tokens == plain.usage.prompt_tokens  # the functions are not shown


def test_a_streamed_call_is_reassembled_by_the_sdk(client):
    body = {"model": MODEL, "messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": 400,
            "temperature": 1.0, "seed": 6}
    whole = client.chat.completions.create(**body)
    with client.chat.completions.stream(**body) as stream:
        final = stream.get_final_completion()
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls, set(SCHEMAS))
    said = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert said == [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    # The deltas themselves: a call opens with its id, type, name and no arguments, then fragments.
    chunks = list(client.chat.completions.create(stream=True, **body))
    deltas = [d for chunk in chunks if chunk.choices for d in chunk.choices[0].delta.tool_calls or []]
    openings = [d for d in deltas if d.id is not None]
    assert [(d.index, d.type, d.function.name, d.function.arguments) for d in openings] == [
        (i, "function", name, "") for i, (name, _) in enumerate(said)]
    for index, (_, arguments) in enumerate(said):
        assert "".join(d.function.arguments for d in deltas if d.index == index) == arguments


def test_history_with_calls_and_results_is_rendered(client):
    history = [*USER, {**PAST_CALL, "content": None}, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    completion = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="required",
                                                max_tokens=400, temperature=1.0, seed=8)
    check_calls(completion.choices[0].message.tool_calls, set(SCHEMAS))
    rendered = call_text("get_weather", '{"city": "Oslo", "days": 1}') + "\n"  # the past call, then <tool_response>...
    expected = len(("<system>" + tools_prompt(FUNCTIONS) + "\n<user>Weather in Oslo?\n<assistant>" + rendered
                    + "<user><tool_response>\nsunny\n</tool_response>\n<assistant>").encode())
    assert completion.usage.prompt_tokens == expected  # its bytes (the template writes no BOS)


def test_langchain_bind_tools_returns_valid_calls(server):
    from langchain_core.messages import AIMessage
    from langchain_openai import ChatOpenAI

    class GetWeather(BaseModel):
        """The forecast for a city."""

        model_config = ConfigDict(extra="forbid")
        city: str = Field(max_length=12)
        days: int = Field(ge=1, le=14)

    llm = ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="none", max_tokens=300, temperature=1.0, seed=3,
                     max_retries=0)
    for choice in ("required", "GetWeather"):
        message = llm.bind_tools([GetWeather], tool_choice=choice).invoke("Weather in Oslo?")
        assert isinstance(message, AIMessage) and message.tool_calls, message
        for call in message.tool_calls:
            assert call["name"] == "GetWeather" and call["id"].startswith("call_")
            GetWeather.model_validate(call["args"])
    city = llm.with_structured_output(GetWeather, method="function_calling").invoke("Weather in Oslo?")
    assert isinstance(city, GetWeather)


BAD = [
    ({"tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice", "missing"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name", "two functions"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "letters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters", "object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "minLength": 5, "maxLength": 2}}, "required": ["a"]}}}], "tool_choice": "required"},
     "tools", "minLength"),
    ({"tools": [{"type": "web_search"}]}, "tools", "function"),
    ({"guided_regex": "a+"}, "guided_regex", "tools and guided_regex"),
    ({"tool_choice": "sometimes"}, "tool_choice", ""),
    ({"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "JSON"),
]


@pytest.mark.parametrize("fields, param, message", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_a_bad_tool_request_is_a_400_naming_its_field(server, fields, param, message):
    body = {"model": MODEL, "messages": USER, "tools": TOOLS, "max_tokens": 5, **fields}
    response = httpx.post(f"{server.url}/v1/chat/completions", json={k: v for k, v in body.items() if v is not None}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith(param) and message in error["message"], error
    server.wait_idle()
