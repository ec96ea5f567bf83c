"""Issue 21: the OpenAI surface real clients send. Each recorded client request
(``client_requests/``: guidellm, the openai SDK, LangChain, LiteLLM, lm-eval) is answered
field by field; fields pagedkv cannot honour are a 400 naming them, unknown ones ignored and
counted; content parts; an optional model; OpenAI's defaults and refusals; the API key; CORS.

In process (FastAPI's TestClient over the tiny model, one byte a token, with a chat template)."""

from __future__ import annotations

import argparse
import hmac
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from pagedkv.engine import Engine
from pagedkv.server import build_app
from pagedkv.server.app import COMPLETIONS_MAX_TOKENS
from pagedkv.server.fields import MAX_NAMED_FIELDS, REFUSED

MODEL = "tiny-served"
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
REQUESTS = sorted((Path(__file__).parent / "client_requests").glob("*.json"))


def engine() -> Engine:
    built = Engine.from_pretrained("tiny", num_blocks=64)
    built.tokenizer.chat_template = TEMPLATE
    return built


@pytest.fixture(scope="module")
def http() -> Iterator[TestClient]:
    served = engine()
    with TestClient(build_app(served, MODEL)) as client:
        yield client
    served.shutdown(drain=False)


def events(response) -> list[dict]:
    """The JSON events of a server-sent-events body, checking it ends with [DONE]."""
    lines = [line[len("data: "):] for line in response.text.split("\n\n") if line]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


def requested_tokens(body: dict) -> int:
    return body.get("max_completion_tokens") or body.get("max_tokens") or COMPLETIONS_MAX_TOKENS


@pytest.mark.parametrize("recorded", REQUESTS, ids=[p.stem for p in REQUESTS])
def test_every_recorded_client_request_is_answered(http, recorded):
    fixture = json.loads(recorded.read_text())
    body = fixture["body"]
    response = http.post(fixture["endpoint"], json=body)
    assert response.status_code == 200, response.text
    chat = fixture["endpoint"].endswith("chat/completions")
    prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) and not isinstance(body["prompt"][0], int) else 1
    choices = prompts * body.get("n", 1)
    if not body.get("stream"):
        answer = response.json()
        assert answer["object"] == ("chat.completion" if chat else "text_completion")
        assert answer["model"] == MODEL and answer["system_fingerprint"].startswith("pagedkv-")
        assert [c["index"] for c in answer["choices"]] == list(range(choices))
        for choice in answer["choices"]:
            text = choice["message"]["content"] if chat else choice["text"]
            assert isinstance(text, str) and choice["finish_reason"] in ("stop", "length")
        usage = answer["usage"]
        assert 0 < usage["completion_tokens"] <= choices * requested_tokens(body)
        if body.get("ignore_eos"):
            assert usage["completion_tokens"] == choices * requested_tokens(body)
        if body.get("logprobs") == 0:  # the chosen token is listed, as OpenAI and vLLM list it
            for choice in answer["choices"]:
                lp = choice["logprobs"]
                assert all(len(top) == 1 and top[token] == chosen
                           for token, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True))
        return
    chunks = events(response)
    assert all(c["object"] == ("chat.completion.chunk" if chat else "text_completion") for c in chunks)
    deltas = [c for c in chunks if c["choices"]]
    texts = [(c["choices"][0]["delta"].get("content") or "") if chat else c["choices"][0]["text"] for c in deltas]
    assert all(isinstance(t, str) for t in texts)
    options = body.get("stream_options", {})
    final = chunks[-1]["usage"] if options.get("include_usage") else None
    if final is not None:
        assert chunks[-1]["choices"] == [] and 0 < final["completion_tokens"] <= requested_tokens(body)
        if body.get("ignore_eos"):
            assert final["completion_tokens"] == requested_tokens(body)
    if options.get("continuous_usage_stats"):
        running = [c["usage"]["completion_tokens"] for c in deltas if "usage" in c]
        assert running == sorted(running) and running[-1] == final["completion_tokens"] and len(set(running)) == len(running)
        assert all(c["usage"]["prompt_tokens"] == final["prompt_tokens"] for c in deltas if "usage" in c)
    else:
        assert all("usage" not in c for c in deltas)


# (Constraints and tools are honoured: tests/server/test_structured_outputs.py, test_tools.py.)
@pytest.mark.parametrize("field, value, endpoint", [
    ("functions", [{"name": "f", "parameters": {}}], "/v1/chat/completions"),
    ("function_call", {"name": "f"}, "/v1/chat/completions"),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}], "/v1/completions"),
    ("tool_choice", "required", "/v1/completions"),
    ("suffix", "y", "/v1/completions"),
    ("min_tokens", 3, "/v1/chat/completions"),
    ("best_of", 3, "/v1/completions"),
])
def test_a_constraint_pagedkv_cannot_honour_is_a_400_naming_it_and_queues_nothing(http, field, value, endpoint):
    body = {"model": MODEL, "max_tokens": 2, field: value}
    body.update({"prompt": "x"} if endpoint == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    before = http.get("/health").json()["num_waiting"]
    response = http.post(endpoint, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and re.search(f"{field}.*not supported", error["message"]), error
    assert http.get("/health").json()["num_waiting"] == before == 0


@pytest.mark.parametrize("field, value", [
    ("response_format", {"type": "text"}), ("tools", []), ("tool_choice", "none"), ("logit_bias", {}),
    ("echo", False), ("min_tokens", 0), ("skip_special_tokens", True), ("best_of", 1),
])
def test_a_value_asking_for_nothing_is_accepted(http, field, value):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, field: value}
    assert http.post("/v1/completions", json=body).status_code == 200


def test_unknown_fields_are_ignored_logged_once_and_counted(caplog):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "store": True, "metadata": {"a": "b"}, "x_unheard_of": 1}
    served = engine()
    with TestClient(build_app(served, MODEL)) as http, caplog.at_level("WARNING", logger="pagedkv.server"):
        for _ in range(2):
            assert http.post("/v1/completions", json=body).status_code == 200
        metrics = http.get("/metrics").text
    served.shutdown(drain=False)
    logged = [r.getMessage() for r in caplog.records if "x_unheard_of" in r.getMessage()]
    assert len(logged) == 1
    assert 'pagedkv:request_fields_ignored_total{field="x_unheard_of"} 2.0' in metrics
    assert 'pagedkv:request_fields_ignored_total{field="store"} 2.0' in metrics


def test_ignored_names_past_the_label_bound_count_as_other():
    served = engine()
    with TestClient(build_app(served, MODEL)) as http:
        names = {f"field_{i}": 1 for i in range(MAX_NAMED_FIELDS + 5)}
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, **names, "bad name!": 1}).status_code == 200
        metrics = http.get("/metrics").text
    served.shutdown(drain=False)
    assert len(re.findall(r'request_fields_ignored_total\{field="field_', metrics)) == MAX_NAMED_FIELDS
    assert 'pagedkv:request_fields_ignored_total{field="other"} 6.0' in metrics


def test_every_refused_field_name_is_a_request_field_of_openai_or_vllm():
    # A guard on the table itself: names are the wire names, snake_case.
    assert all(re.fullmatch(r"[a-z_]+", name) for name in REFUSED)


def test_content_parts_other_than_text_are_refused_and_null_content_needs_tool_calls(http):
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": image}], "max_tokens": 1})
    assert response.status_code == 400 and "image_url" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "messages[0].content[0]"
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": None}], "max_tokens": 1})
    assert response.status_code == 400 and "content is required" in response.json()["error"]["message"]
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                       "function": {"name": "w", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    response = http.post("/v1/chat/completions", json={"messages": history, "max_tokens": 2})
    assert response.status_code == 200, response.text


def test_openai_defaults_and_refusals(http):
    # /v1/completions without max_tokens: OpenAI's 16.
    answer = http.post("/v1/completions", json={"prompt": "x", "temperature": 0, "ignore_eos": True}).json()
    assert answer["usage"]["completion_tokens"] == COMPLETIONS_MAX_TOKENS == 16
    # stream_options without stream.
    response = http.post("/v1/completions", json={"prompt": "x", "stream_options": {"include_usage": True}})
    assert response.status_code == 400 and "stream_options" in response.json()["error"]["message"]
    # best_of below n.
    response = http.post("/v1/completions", json={"prompt": "x", "n": 2, "best_of": 1, "max_tokens": 1})
    assert response.status_code == 400 and "best_of" in response.json()["error"]["message"]
    # best_of equal to n is n samples.
    answer = http.post("/v1/completions", json={"prompt": "x", "n": 2, "best_of": 2, "max_tokens": 1}).json()
    assert len(answer["choices"]) == 2


def test_models_by_id_ping_and_unknown_routes(http):
    card = http.get(f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["object"] == "model"
    missing = http.get("/v1/models/gpt-9")
    assert missing.status_code == 404 and "gpt-9" in missing.json()["error"]["message"]
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    nowhere = http.get("/v1/nowhere")
    assert nowhere.status_code == 404 and set(nowhere.json()["error"]) == {"message", "type", "param", "code"}


def test_the_api_key_guards_every_route_but_health_and_metrics():
    served = engine()
    with TestClient(build_app(served, MODEL, api_key="s3cret")) as http:
        body = {"prompt": "x", "max_tokens": 1}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}, {"Authorization": "s3cret"}):
            response = http.post("/v1/completions", json=body, headers=headers)
            assert response.status_code == 401 and response.headers["WWW-Authenticate"] == "Bearer"
            assert response.json()["error"]["type"] == "AuthenticationError"
            assert http.get("/v1/models", headers=headers).status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert http.post("/v1/completions", json=body, headers=ok).status_code == 200
        assert http.get("/v1/models", headers=ok).status_code == 200
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
    with TestClient(build_app(served, MODEL, api_key="s3cret", protect_metrics=True)) as http:
        assert http.get("/metrics").status_code == 401 and http.get("/health").status_code == 401
        assert http.get("/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert http.get("/ping").status_code == 200
    served.shutdown(drain=False)


def test_the_key_comparison_takes_no_longer_for_a_closer_guess():
    """The comparison is of SHA-256 digests (fixed length): its cost does not depend on how much
    of the key a guess gets right. Checked by counting, not timing: every guess, right prefix or
    not, is hashed in full and compared over 32 bytes."""
    import pagedkv.server.auth as auth_module
    from pagedkv.server.auth import ApiKeyAuth

    auth = ApiKeyAuth(lambda *a: None, "k" * 40)  # type: ignore[arg-type]
    compared: list[tuple[int, int]] = []
    compare = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append((len(a), len(b)))
        return compare(a, b)

    answers = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(auth_module.hmac, "compare_digest", counting)
        for guess in (b"x", b"k" * 39 + b"x", b"k" * 40, b"k" * 400):
            answers.append(auth._authorized({"headers": [(b"authorization", b"Bearer " + guess)]}))
    assert compared == [(32, 32)] * 4 and answers == [False, False, True, False]


def test_cors_answers_allowed_origins_only():
    served = engine()
    with TestClient(build_app(served, MODEL, api_key="k", allowed_origins=["http://app.example"])) as http:
        preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}
        response = http.options("/v1/chat/completions", headers=preflight)
        assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "http://app.example"
        refused = http.options("/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in refused.headers
    with TestClient(build_app(served, MODEL)) as http:  # off by default
        response = http.get("/v1/models", headers={"Origin": "http://app.example"})
        assert "access-control-allow-origin" not in response.headers
    served.shutdown(drain=False)


def test_serve_takes_the_key_from_the_environment_and_refuses_protect_metrics_without_one(monkeypatch):
    env = {k: v for k, v in os.environ.items() if k != "PAGEDKV_API_KEY"}
    refused = subprocess.run([sys.executable, "-m", "pagedkv", "serve", "--model", "tiny", "--protect-metrics"],
                             capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 2 and "--protect-metrics needs --api-key" in refused.stderr
    from pagedkv.server.launch import add_arguments

    monkeypatch.setenv("PAGEDKV_API_KEY", "from-env")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).api_key == "from-env"
    assert parser.parse_args(["--allowed-origins", "http://a.example, *"]).allowed_origins == ("http://a.example", "*")
    with pytest.raises(SystemExit):
        parser.parse_args(["--allowed-origins", "a.example/"])


def test_tokenize_and_detokenize_in_vllms_shapes(http):
    text = http.post("/tokenize", json={"prompt": "hello"}).json()
    assert text["count"] == len(text["tokens"]) and text["max_model_len"] > 0
    bare = http.post("/tokenize", json={"prompt": "hello", "add_special_tokens": False}).json()
    assert http.post("/detokenize", json={"tokens": bare["tokens"]}).json() == {"prompt": "hello"}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}).json()
    assert http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"] == "<user>hi\n<assistant>"
    # What a chat request of the same messages is given: its usage counts the same prompt tokens.
    answer = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).json()
    assert answer["usage"]["prompt_tokens"] == chat["count"]
    for bad in ({}, {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}):
        assert http.post("/tokenize", json=bad).status_code == 400
    assert http.post("/detokenize", json={"tokens": [10**9]}).status_code == 400
    assert http.post("/tokenize", json={"prompt": "x", "model": "gpt-9"}).status_code == 404


def test_logit_bias_forces_and_bans_tokens(http):
    """Through the Rust sampler: +100 on one token makes it every greedy token; -100 bans a token
    from a sampled row, and +30 makes another most of it."""
    [a] = http.post("/tokenize", json={"prompt": "a", "add_special_tokens": False}).json()["tokens"]
    forced = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                                "logit_bias": {str(a): 100}}).json()
    assert forced["choices"][0]["text"] == "a" * 6
    [b] = http.post("/tokenize", json={"prompt": "b", "add_special_tokens": False}).json()["tokens"]
    body = {"prompt": "x", "max_tokens": 6, "temperature": 0.8, "seed": 3, "ignore_eos": True,
            "logit_bias": {str(a): -100, str(b): 30}}
    sampled = http.post("/v1/completions", json=body).json()
    assert sampled["choices"][0]["text"] == "b" * 6  # e^-37 for any other token
    for bad in ({"x": 1}, {"97": 101}, {"-1": 1}, {str(10**6): 1}):
        response = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "logit_bias": bad})
        assert response.status_code == 400 and "logit_bias" in response.json()["error"]["message"], (bad, response.text)


def test_echo_with_logprobs_scores_the_prompt_as_the_model_does(http):
    """lm-eval's loglikelihood request: token ids, echo, logprobs 1, max_tokens 0 (and 1). The
    prompt's logprobs are the model's own (a dense forward over the prompt), equal whether the
    prompt was cached by an earlier request or not, and the first token's is null."""
    import numpy as np

    from pagedkv.engine import Engine
    from support.prefill import prefill_logits

    prompt = list(range(40, 80))
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    scored = http.post("/v1/completions", json=body).json()
    choice = scored["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert scored["usage"] == {**scored["usage"], "prompt_tokens": len(prompt), "completion_tokens": 0}
    reference = Engine.from_pretrained("tiny", num_blocks=64)  # the same seed-0 weights
    logits = prefill_logits(reference.core.runner.model, prompt)
    reference.shutdown()
    peak = logits.max(axis=1, keepdims=True)
    log_softmax = logits - peak - np.log(np.exp(logits - peak).sum(axis=1, keepdims=True))
    want = [float(log_softmax[p, prompt[p + 1]]) for p in range(len(prompt) - 1)]
    assert np.allclose(lp["token_logprobs"][1:], want, atol=1e-4)
    for p, top in enumerate(lp["top_logprobs"][1:]):  # the chosen token and the most likely one
        assert max(top.values()) == pytest.approx(float(log_softmax[p].max()), abs=1e-4)
    # With the prompt cached by a plain request first: the same scores (a scoring request
    # computes its prompt whole).
    assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code == 200
    again = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["token_logprobs"]
    assert again == lp["token_logprobs"]
    # max_tokens 1: the prompt's scores, then the generated token's.
    one = http.post("/v1/completions", json={**body, "max_tokens": 1}).json()
    assert one["usage"]["completion_tokens"] == 1 and len(one["choices"][0]["logprobs"]["tokens"]) == len(prompt) + 1
    assert one["choices"][0]["logprobs"]["token_logprobs"][: len(prompt)] == lp["token_logprobs"]
    # vLLM's prompt_logprobs alone, echo without logprobs, and what is refused.
    assert http.post("/v1/completions", json={"prompt": prompt, "prompt_logprobs": 2, "max_tokens": 1}).status_code == 200
    echoed = http.post("/v1/completions", json={"prompt": "abc", "echo": True, "max_tokens": 2}).json()["choices"][0]
    assert echoed["text"].startswith("abc") and echoed["logprobs"] is None
    refused = http.post("/v1/completions", json={**body, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}).status_code == 400


def test_the_responses_api_through_the_openai_sdk(http):
    """``client.responses.create`` whole and streamed (the SDK parses every event), text parts
    as input, and what is refused because nothing is stored."""
    import openai

    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
    whole = sdk.responses.create(model=MODEL, instructions="be brief", input="hello", max_output_tokens=5, temperature=0,
                                 store=False)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 5 and isinstance(whole.output_text, str)
    parts = [{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}]
    events = list(sdk.responses.create(model=MODEL, input=parts, instructions="be brief", max_output_tokens=5, temperature=0,
                                       stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] == "response.incomplete" and [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text == events[-1].response.output_text  # greedy: the same text
    for field, value in (("store", True), ("previous_response_id", "resp_1"), ("tools", [{"type": "web_search"}])):
        response = http.post("/v1/responses", json={"input": "x", field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field
