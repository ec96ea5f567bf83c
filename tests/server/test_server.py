"""`pagedkv serve` as a subprocess on 127.0.0.1, driven by the official openai client (and httpx
where the wire format itself is under test): completions and chat, streamed and not, n=2, stop
strings across tokens, usage and cached tokens, logprobs, every error case, disconnects aborting
their requests (seen in the block counts of /health), a bounded load test, and SIGTERM under load.

The built-in tiny model has random weights and the byte tokenizer, which ships no chat template:
the server is given one with --chat-template. Every token is one byte, so any stop string of two
characters or more spans tokens.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from served import MODEL, Server


def greedy(**fields):
    return {"model": MODEL, "temperature": 0.0, "extra_body": {"ignore_eos": True}, **fields}


# ---- endpoints ------------------------------------------------------------------------------------


def test_models_health_version_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert server.health()["status"] == "ok"
    assert httpx.get(f"{server.url}/version").json()["version"]
    metrics = httpx.get(f"{server.url}/metrics")
    assert metrics.status_code == 200 and "pagedkv:num_requests_running" in metrics.text


def test_completion_whole_and_streamed_agree_and_count_usage(client):
    whole = client.completions.create(prompt="Once upon", max_tokens=12, **greedy())
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.index == 0 and len(choice.text) > 0
    assert whole.usage.prompt_tokens == len("Once upon") + 1  # bytes and BOS
    assert whole.usage.completion_tokens == 12 and whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    chunks = list(client.completions.create(prompt="Once upon", max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **greedy()))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_whole_and_streamed_agree(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(messages=messages, max_completion_tokens=10, **greedy())
    message = whole.choices[0].message
    assert message.role == "assistant" and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len("<system>Be brief.\n<user>Hi\n<assistant>")  # the template's text, no BOS
    chunks = list(client.chat.completions.create(messages=messages, max_completion_tokens=10, stream=True, **greedy()))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_2_and_a_seeded_stream_say_what_the_whole_response_says(client):
    fields = {"model": MODEL, "prompt": "abc", "max_tokens": 10, "n": 2, "temperature": 1.0, "seed": 7,
              "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**fields)
    assert sorted(c.index for c in whole.choices) == [0, 1]
    texts = {c.index: c.text for c in whole.choices}
    assert texts[0] != texts[1]  # two independent samples (10 random bytes each)
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(stream=True, **fields):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts


def test_a_list_of_prompts_and_token_ids(client):
    response = client.completions.create(prompt=["ab", "cd"], max_tokens=3, n=2, **greedy())
    assert sorted(c.index for c in response.choices) == [0, 1, 2, 3]
    assert response.usage.prompt_tokens == 6 and response.usage.completion_tokens == 12
    by_ids = client.completions.create(prompt=[1, 100, 101], max_tokens=3, **greedy())
    assert by_ids.usage.prompt_tokens == 3


def test_stop_strings_match_across_tokens(client):
    free = client.completions.create(prompt="Stop here", max_tokens=24, **greedy()).choices[0].text
    stop = free[6:9]  # three bytes at least: three tokens
    cut = free[: free.index(stop)]
    whole = client.completions.create(prompt="Stop here", max_tokens=24, stop=[stop], **greedy()).choices[0]
    assert (whole.text, whole.finish_reason) == (cut, "stop")
    chunks = list(client.completions.create(prompt="Stop here", max_tokens=24, stop=stop, stream=True, **greedy()))
    assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"


def test_stop_token_ids_end_a_sample(client):
    every_id = list(range(512))  # the tiny model's vocabulary: its first token is one of them
    response = client.completions.create(prompt="xyz", max_tokens=8, **greedy(extra_body={"stop_token_ids": every_id}))
    assert response.choices[0].finish_reason == "stop" and response.usage.completion_tokens == 1


def test_cached_tokens_count_a_repeated_prefix(client):
    prompt = "A shared system prompt long enough to fill several sixteen-token blocks of the cache. "
    first = client.completions.create(prompt=prompt + "one", max_tokens=2, **greedy())
    second = client.completions.create(prompt=prompt + "two", max_tokens=2, **greedy())
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    full_blocks = (len(prompt) + 1) // 16 * 16
    assert second.usage.prompt_tokens_details.cached_tokens == full_blocks
    salted = client.completions.create(prompt=prompt + "two", max_tokens=2, **greedy(extra_body={"ignore_eos": True,
                                                                                                "cache_salt": "tenant-b"}))
    assert salted.usage.prompt_tokens_details.cached_tokens == 0  # another tenant's cache


def test_logprobs_of_completions_and_chat(client):
    response = client.completions.create(prompt="log", max_tokens=5, logprobs=3, **greedy())
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == response.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(chosen)  # greedy: the top one
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True,
                                          top_logprobs=2, **greedy())
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)
    streamed = [c.choices[0].logprobs.content[0].logprob for c in client.chat.completions.create(
        messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True, stream=True, **greedy())
        if c.choices[0].logprobs]
    assert streamed == pytest.approx([t.logprob for t in content], abs=1e-5)


# ---- errors ---------------------------------------------------------------------------------------


def error_of(raised: pytest.ExceptionInfo) -> dict:
    body = raised.value.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["code"] == raised.value.status_code
    return body


@pytest.mark.parametrize("fields, param", [
    ({"suffix": "y"}, "suffix"),  # a field not supported
    ({"extra_body": {"temperature": "hot"}}, "temperature"),  # a wrong type
    ({"extra_body": {"max_tokens": True}}, "max_tokens"),  # a bool is not an int
    ({"prompt": ""}, "prompt"),  # an empty prompt
])
def test_malformed_bodies_are_400s_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(**{"model": MODEL, "prompt": "x", "max_tokens": 2, **fields})
    assert error_of(raised)["param"].startswith(param)


@pytest.mark.parametrize("fields, message", [
    ({"prompt": "x" * 5000}, "max_model_len|longer|exceed"),  # past the model's 4096 positions
    ({"n": 33}, "max_num_seqs|n "),  # above the sequence cap (32)
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"stop": [""]}, "stop"),
    ({"logprobs": 30}, "top_logprobs"),
])
def test_values_the_engine_refuses_are_400s(server, client, fields, message):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(**{"model": MODEL, "prompt": "x", "max_tokens": 2, **fields})
    assert re.search(message, error_of(raised)["message"]), error_of(raised)
    assert server.health()["num_waiting"] == 0  # nothing was queued


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert "gpt-9" in error_of(raised)["message"]


def test_what_is_not_json_or_not_a_route_is_never_a_500(server):
    for response in (
        httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
        httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": []}),
        httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user"}]}),
        httpx.post(f"{server.url}/v1/completions", json=[1, 2]),
    ):
        assert response.status_code == 400 and "error" in response.json(), response.text
    missing = httpx.get(f"{server.url}/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404


# ---- disconnects and load -------------------------------------------------------------------------


def test_a_disconnected_stream_returns_its_blocks(server):
    body = {"model": MODEL, "prompt": "long " * 20, "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        busy = server.health()
        assert busy["num_running"] == 1 and busy["blocks_in_use"] >= 7  # 101 prompt tokens and more
        # The tiny model's layout is one full-attention group of its layers, holding every block.
        [group] = busy["kv_groups"]
        assert group["attention"] == "full" and group["blocks_in_use"] == busy["blocks_in_use"]
        assert group["block_size"] == 16
    server.wait_idle(timeout=2.0)


def test_a_disconnected_whole_request_returns_its_blocks(server):
    body = {"model": MODEL, "prompt": "long " * 20, "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    server.wait_idle(timeout=2.0)


async def _stream(http: httpx.AsyncClient, url: str, body: dict, leave_after: int | None,
                  started: asyncio.Event | None = None) -> tuple[str, list[dict]]:
    """Reads one SSE stream: ("done" | "left", its JSON events); leaves after ``leave_after`` events;
    sets ``started`` at the first."""
    events: list[dict] = []
    async with http.stream("POST", url, json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            if line == "data: [DONE]":
                return "done", events
            events.append(json.loads(line[6:]))
            if started is not None:
                started.set()
            if leave_after is not None and len(events) >= leave_after:
                return "left", events
    return "cut", events


def test_load_64_streams_5_rounds_a_quarter_leaving(server):
    url = f"{server.url}/v1/completions"

    async def load() -> None:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:
            for round_ in range(5):
                bodies = [{"model": MODEL, "prompt": f"round {round_} client {i}", "max_tokens": 6 if i % 4 else 400,
                           "stream": True, "ignore_eos": True, "temperature": 0.8, "seed": i} for i in range(64)]
                results = await asyncio.gather(*(_stream(http, url, b, None if i % 4 else 2) for i, b in enumerate(bodies)))
                for i, (end, events) in enumerate(results):
                    assert not any("error" in e for e in events), events
                    if i % 4:
                        assert end == "done" and events[-1]["choices"][0]["finish_reason"] == "length"
                    else:
                        assert end == "left"

    asyncio.run(asyncio.wait_for(load(), timeout=120))
    server.wait_idle(timeout=5.0)


# ---- servers of their own: a full queue, SIGTERM --------------------------------------------------


def test_a_full_queue_is_a_429_with_retry_after(tmp_path):
    small = Server(tmp_path, "--max-num-seqs", "1", "--max-waiting", "1")
    try:
        body = {"model": MODEL, "prompt": "busy", "max_tokens": 3000, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=30) as http, http.stream("POST", f"{small.url}/v1/completions", json=body) as running:
            lines = running.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)  # admitted: it runs
            with http.stream("POST", f"{small.url}/v1/completions", json=body) as waiting:
                assert waiting.status_code == 200
                deadline = time.monotonic() + 5
                while small.health()["num_waiting"] < 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                with pytest.raises(openai.RateLimitError) as raised:
                    small.client().completions.create(model=MODEL, prompt="one more", max_tokens=2)
                assert raised.value.response.headers["retry-after"] == "1"
                assert error_of(raised)["type"] == "RateLimitError"
    finally:
        small.stop()


def test_sigterm_drains_then_aborts_and_every_stream_ends(tmp_path):
    busy = Server(tmp_path, "--max-num-seqs", "12", "--shutdown-timeout", "1.5")
    url = f"{busy.url}/v1/completions"

    async def load() -> list[tuple[str, list[dict]]]:
        async with httpx.AsyncClient(timeout=30) as http:
            # Half finish within the drain timeout, half would run for minutes: they are aborted.
            bodies = [{"model": MODEL, "prompt": f"client {i}", "max_tokens": 8 if i % 2 else 100_000, "stream": True,
                       "ignore_eos": True} for i in range(12)]
            started = [asyncio.Event() for _ in bodies]
            streams = [asyncio.ensure_future(_stream(http, url, b, None, s)) for b, s in zip(bodies, started, strict=True)]
            await asyncio.gather(*(s.wait() for s in started))  # every one admitted (or already done)
            busy.process.send_signal(signal.SIGTERM)
            return await asyncio.gather(*streams)

    try:
        results = asyncio.run(asyncio.wait_for(load(), timeout=60))
        assert busy.process.wait(timeout=20) == 0
    finally:
        busy.stop()
    finished = aborted = 0
    for end, events in results:
        assert end == "done", events  # every stream got its [DONE]
        last = events[-1]
        if "error" in last:
            assert "shut down" in last["error"]["message"] and last["error"]["code"] == 503
            aborted += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length"
            finished += 1
    assert finished == 6 and aborted == 6
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{busy.url}/health", timeout=2)  # nothing listens any more


def test_a_closed_engine_is_a_503_with_retry_after():
    """In process: what a request meets between SIGTERM and the listening socket's closing."""
    from fastapi.testclient import TestClient

    from pagedkv.engine import Engine
    from pagedkv.server import build_app

    engine = Engine.from_pretrained("tiny", num_blocks=16)
    engine.shutdown()
    with TestClient(build_app(engine, MODEL)) as http:
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["type"] == "ServiceUnavailableError"


def test_without_the_server_extra_only_serve_is_unavailable():
    hide = "import sys; sys.modules['fastapi'] = None; from pagedkv.__main__ import main; sys.exit(main(sys.argv[1:]))"
    serve = subprocess.run([sys.executable, "-c", hide, "serve", "--port", "1"], capture_output=True, text=True, timeout=60)
    assert serve.returncode == 1 and "needs fastapi" in serve.stderr and "pagedkv[server]" in serve.stderr
    demo = subprocess.run([sys.executable, "-c", hide, "demo", "--help"], capture_output=True, text=True, timeout=60)
    assert demo.returncode == 0 and "--num-blocks" in demo.stdout
