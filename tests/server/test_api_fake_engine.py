"""Routes, streaming, disconnects and failure paths of the server, over a scripted fake engine."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from heron.config import EngineConfig
from heron.engine.async_engine import AsyncEngine
from heron.sampling_params import SamplingParams


def letters_after(c: str, n: int, choice: int = 0) -> str:
    """What the fake engine generates after a prompt ending in ``c``."""
    return "".join(chr(97 + (ord(c) - 97 + i + 1 + choice) % 26) for i in range(n))


@pytest.fixture(scope="module")
def client(fake_server):
    return openai.OpenAI(base_url=fake_server.url + "/v1", api_key="unused", max_retries=0)


def test_completion_text_and_usage(client):
    r = client.completions.create(model="fake", prompt="abc", max_tokens=5, temperature=0)
    assert r.choices[0].text == letters_after("c", 5)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 5, 8)


def test_completion_streaming_joins_to_whole_text(client):
    chunks = list(client.completions.create(model="fake", prompt="xy", max_tokens=7, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == letters_after("y", 7)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completion_many_prompts_token_ids_and_n(client):
    r = client.completions.create(model="fake", prompt=["ab", "cd"], max_tokens=2, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in r.choices}
    assert by_index[0] == letters_after("b", 2) and by_index[1] == letters_after("b", 2, choice=1)
    assert by_index[2] == letters_after("d", 2)
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 8
    r = client.completions.create(model="fake", prompt=[0, 1, 2], max_tokens=1)
    assert r.choices[0].text == "d" and r.usage.prompt_tokens == 3


def test_completion_echo_and_logprobs(client):
    r = client.completions.create(model="fake", prompt="ab", max_tokens=3, echo=True, logprobs=2)
    c = r.choices[0]
    assert c.text == "ab" + letters_after("b", 3)
    assert c.logprobs.tokens == list(c.text)
    assert c.logprobs.token_logprobs == [None, None, -0.5, -0.5, -0.5]
    assert c.logprobs.text_offset == [0, 1, 2, 3, 4]
    assert c.logprobs.top_logprobs[2] == {"c": -0.5}


def test_chat_stream_equals_whole_with_n(client):
    messages = [{"role": "system", "content": "ab"}, {"role": "user", "content": [{"type": "text", "text": "c"}]}]
    whole = client.chat.completions.create(model="fake", messages=messages, max_tokens=4, n=2)
    assert [c.message.content for c in whole.choices] == [letters_after("c", 4), letters_after("c", 4, 1)]
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == 3 and whole.usage.completion_tokens == 8
    texts = {0: "", 1: ""}
    roles = set()
    for chunk in client.chat.completions.create(model="fake", messages=messages, max_tokens=4, n=2, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            roles.add(c.delta.role)
    assert texts == {0: whole.choices[0].message.content, 1: whole.choices[1].message.content}
    assert "assistant" in roles


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "a"}], max_tokens=2,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == ["b", "c"]
    assert len(content[0].top_logprobs) == 3 and content[0].bytes == [ord("b")]


def test_models_version_tokenize(fake_server, client):
    assert [m.id for m in client.models.list().data] == ["fake"]
    assert httpx.get(fake_server.url + "/version").json()["version"]
    tok = httpx.post(fake_server.url + "/tokenize", json={"prompt": "abc"}).json()
    assert tok == {"count": 3, "max_model_len": 64, "tokens": [0, 1, 2]}
    assert httpx.post(fake_server.url + "/detokenize", json={"tokens": [7, 8]}).json() == {"prompt": "hi"}
    r = httpx.post(fake_server.url + "/detokenize", json={"tokens": [99]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="a")
    assert e.value.body["code"] == "model_not_found"


def test_max_tokens_over_context_is_400_with_numbers(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="fake", prompt="abcd", max_tokens=100)
    assert "64" in e.value.message and "104" in e.value.message
    assert e.value.body["param"] == "max_tokens"


def _wait_until(cond, timeout: float = 5.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_streaming_disconnect_aborts_in_engine(fake_server):
    fake = fake_server.fake
    before = len(fake.aborted)
    with httpx.stream("POST", fake_server.url + "/v1/completions",
                      json={"prompt": "a", "max_tokens": 40, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    assert _wait_until(lambda: len(fake.aborted) == before + 1)
    assert _wait_until(lambda: fake_server.engine.num_in_flight == 0)


def test_non_streaming_disconnect_aborts_in_engine(fake_server):
    fake = fake_server.fake
    before = len(fake.aborted)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fake_server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 60}, timeout=0.1)
    assert _wait_until(lambda: len(fake.aborted) == before + 1)
    assert not fake.requests


def test_concurrent_streams_are_batched_and_metrics_parse(fake_server, client):
    def run(i: int, out: list) -> None:
        out.append("".join(c.choices[0].text for c in client.completions.create(
            model="fake", prompt="abc"[i % 3], max_tokens=10, stream=True)))

    results: list[str] = []
    threads = [threading.Thread(target=run, args=(i, results)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == sorted(letters_after("abc"[i % 3], 10) for i in range(16))
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(fake_server.url + "/metrics").text)}
    assert families["heron:max_num_requests_running_seen"].samples[0].value > 1
    assert families["heron:num_requests_running"].samples[0].labels == {"model_name": "fake"}
    ttft = {s.name: s.value for s in families["heron:time_to_first_token_seconds"].samples}
    assert ttft["heron:time_to_first_token_seconds_count"] >= 16
    itl = {s.name: s.value for s in families["heron:inter_token_latency_seconds"].samples}
    assert itl["heron:inter_token_latency_seconds_count"] >= 16 * 9
    success = {s.labels["finished_reason"]: s.value for s in families["heron:request_success"].samples
               if s.name == "heron:request_success_total"}
    assert success["length"] >= 16


def test_api_key(start_server):
    server, stop = start_server(api_key="sekret")
    try:
        assert httpx.get(server.url + "/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "a"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="sekret", max_retries=0)
        assert good.completions.create(model="fake", prompt="a", max_tokens=1).choices[0].text == "b"
    finally:
        stop()


def test_step_failure_fails_requests_with_500_and_marks_unhealthy(start_server):
    server, stop = start_server()
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "boom", "max_tokens": 3})
        assert r.status_code == 500
        assert r.json()["error"]["code"] == "engine_dead" and "Traceback" not in r.text
        assert httpx.get(server.url + "/health").status_code == 500
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "a"})
        assert r.status_code == 500
    finally:
        stop()


def test_step_failure_mid_stream_ends_stream_with_error_event(start_server):
    server, stop = start_server()
    try:
        with httpx.stream("POST", server.url + "/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "boom"}], "stream": True}) as r:
            events = [line for line in r.iter_lines() if line]
        assert r.status_code == 200
        assert json.loads(events[-2][len("data: "):])["error"]["code"] == "engine_dead"
        assert events[-1] == "data: [DONE]"
    finally:
        stop()


def test_health_is_503_while_loading(start_server, fake_engine_cls):
    release = threading.Event()

    def slow_factory(config):
        release.wait(10)
        return fake_engine_cls(config)

    server, stop = start_server(engine_factory=slow_factory, wait=False)
    try:
        assert httpx.get(server.url + "/health").status_code == 503
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "a"})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        release.set()
        assert _wait_until(lambda: httpx.get(server.url + "/health").status_code == 200)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.json()["choices"][0]["text"] == "bc"
    finally:
        release.set()
        stop()


def test_generate_yields_cumulative_outputs(fake_engine_cls):
    async def scenario() -> list[str]:
        engine = AsyncEngine(EngineConfig(model="fake"), fake_engine_cls)
        engine.start()
        await engine.wait_loaded()
        texts = [o.outputs[0].text async for o in engine.generate("ab", SamplingParams(max_tokens=3), "r1")]
        engine.shutdown()
        return texts

    texts = asyncio.run(scenario())
    assert texts[-1] == "cde" and all("cde".startswith(t) for t in texts)
