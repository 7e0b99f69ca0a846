"""Routes, streaming, disconnects and failure paths of the server, over a scripted fake core in its own process."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from heron.config import EngineConfig
from heron.engine.async_engine import AsyncEngine
from heron.sampling_params import SamplingParams

from .conftest import metric_values
from .fake_core import FakeCore, FakeTokenizer, RecordingTokenizer


def letters_after(c: str, n: int, choice: int = 0) -> str:
    """What the fake core generates after a prompt ending in ``c``."""
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
    assert c.logprobs.token_logprobs == [None, -0.5, -0.5, -0.5, -0.5]
    assert c.logprobs.text_offset == [0, 1, 2, 3, 4]
    assert c.logprobs.top_logprobs[1] == {"b": -0.5, "c": -1.5}
    assert c.logprobs.top_logprobs[2] == {"c": -0.5, "d": -1.5}


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


def test_core_rejection_is_400_before_streaming(fake_server):
    body = {"prompt": [0] * 70, "max_tokens": 1, "stream": True}  # token ids: the core, not the front end, refuses
    r = httpx.post(fake_server.url + "/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "prompt" and fake_server.engine.num_in_flight == 0


def _wait_until(cond, timeout: float = 5.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def _idle_with_aborts(url: str, aborts: float) -> bool:
    """Whether the core runs nothing, holds no KV blocks and has counted ``aborts`` aborted requests."""
    m = metric_values(url)
    return (m["heron:num_requests_running"] == 0 and m["heron:kv_cache_usage_perc"] == 0
            and m["heron:request_success_total{finished_reason=abort}"] == aborts)


def test_streaming_disconnect_aborts_in_engine(fake_server):
    before = metric_values(fake_server.url)["heron:request_success_total{finished_reason=abort}"]
    with httpx.stream("POST", fake_server.url + "/v1/completions",
                      json={"prompt": "a", "max_tokens": 40, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    assert _wait_until(lambda: _idle_with_aborts(fake_server.url, before + 1))
    assert _wait_until(lambda: fake_server.engine.num_in_flight == 0)


def test_non_streaming_disconnect_aborts_in_engine(fake_server):
    before = metric_values(fake_server.url)["heron:request_success_total{finished_reason=abort}"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fake_server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 60}, timeout=0.1)
    assert _wait_until(lambda: _idle_with_aborts(fake_server.url, before + 1))
    assert fake_server.engine.num_in_flight == 0


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


def _assert_dead(url: str) -> None:
    """/health answers 503 within 5 s, and a new request gets an OpenAI-shaped engine_dead error."""
    assert _wait_until(lambda: httpx.get(url + "/health").status_code == 503)
    r = httpx.post(url + "/v1/completions", json={"prompt": "a"})
    assert r.status_code == 500 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["code"] == "engine_dead" and "Traceback" not in r.text


def _stream_events(url: str, body: dict, on_first=None) -> list[str]:
    """The non-empty lines of a streamed request; ``on_first()`` runs once the first content token is in."""
    events: list[str] = []
    with httpx.stream("POST", url, json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line:
                events.append(line)
            if on_first is not None and len(events) == 2:
                on_first()
    return events


def test_step_failure_fails_requests_with_500_and_marks_unhealthy(start_server):
    server, stop = start_server()
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "boom", "max_tokens": 5})
        assert r.status_code == 500
        assert r.json()["error"]["code"] == "engine_dead" and "Traceback" not in r.text
        _assert_dead(server.url)
    finally:
        stop()


def test_step_failure_mid_stream_ends_stream_with_error_event(start_server, caplog, capfd):
    server, stop = start_server(step_delay=0.01)
    try:
        body = {"messages": [{"role": "user", "content": "boom"}], "stream": True, "max_tokens": 20}
        events = _stream_events(server.url + "/v1/chat/completions", body)
        content = "".join(json.loads(e[len("data: "):])["choices"][0]["delta"]["content"] for e in events[:-2])
        assert content == letters_after("m", 2)  # the tokens before the failing step came through
        error = json.loads(events[-2][len("data: "):])["error"]
        assert error["code"] == "engine_dead" and "scripted failure" in error["message"]
        assert events[-1] == "data: [DONE]"
        _assert_dead(server.url)
    finally:
        stop()
    died = [m for m in (r.getMessage() for r in caplog.records) if "engine core process" in m and "died" in m]
    assert len(died) == 1 and "RuntimeError: scripted failure" in died[0] and "exit code 1" in died[0]
    core_log = capfd.readouterr().err
    assert "Traceback" in core_log and "RuntimeError: scripted failure" in core_log


def test_core_killed_mid_stream(start_server, caplog):
    server, stop = start_server(step_delay=0.02)
    try:
        body = {"prompt": "a", "max_tokens": 60, "stream": True}
        started = time.time()
        events = _stream_events(server.url + "/v1/completions", body,
                                on_first=lambda: os.kill(server.engine.core_pid, signal.SIGKILL))
        assert time.time() - started < 5
        assert 2 <= len(events) < 60
        assert json.loads(events[-2][len("data: "):])["error"]["code"] == "engine_dead"
        assert events[-1] == "data: [DONE]"
        _assert_dead(server.url)
    finally:
        stop()
    assert any("killed by SIGKILL" in r.getMessage() for r in caplog.records)


def test_tokenizer_used_by_one_thread_at_a_time(start_server):
    tokenizer = RecordingTokenizer()
    server, stop = start_server(step_delay=0.002, tokenizer=tokenizer)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    async def stream(i: int) -> str:
        chunks = await client.completions.create(model="fake", prompt="abc"[i % 3] * 3, max_tokens=8, stream=True)
        return "".join([c.choices[0].text async for c in chunks])

    async def chat(i: int) -> str:
        r = await client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "xy"}],
                                                 max_tokens=3, stop=["zz"])
        return r.choices[0].message.content

    async def echo(i: int) -> str:
        r = await client.completions.create(model="fake", prompt=[3, 4], max_tokens=2, echo=True, logprobs=1)
        return r.choices[0].text

    async def tokenize(i: int) -> dict:
        async with httpx.AsyncClient() as http:
            body = {"prompt": "hello"} if i % 2 else {"messages": [{"role": "user", "content": "hi"}]}
            tok = (await http.post(server.url + "/tokenize", json=body)).json()
            return (await http.post(server.url + "/detokenize", json={"tokens": tok["tokens"]})).json()

    async def run_all() -> list:
        try:
            return await asyncio.gather(*(f(i) for i in range(8) for f in (stream, chat, echo, tokenize)))
        finally:
            await client.close()

    try:
        results = asyncio.run(run_all())
    finally:
        stop()
    assert results[:4] == [letters_after("a", 8), letters_after("y", 3), "de" + letters_after("e", 2),
                           {"prompt": "hi"}]
    assert tokenizer.calls > 100 and tokenizer.overlaps == 0
    assert len(tokenizer.threads) == 1 and next(iter(tokenizer.threads)).startswith("heron-frontend")


def test_health_is_503_while_loading(start_server, tmp_path):
    gate = tmp_path / "loaded"
    server, stop = start_server(core_factory=functools.partial(FakeCore, load_gate=str(gate)), wait=False)
    try:
        assert httpx.get(server.url + "/health").status_code == 503
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "a"})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        gate.touch()
        assert _wait_until(lambda: httpx.get(server.url + "/health").status_code == 200, timeout=30)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.json()["choices"][0]["text"] == "bc"
    finally:
        gate.touch()
        stop()


def test_generate_yields_deltas():
    async def scenario() -> list[str]:
        engine = AsyncEngine(EngineConfig(model="fake"), FakeCore, lambda _: FakeTokenizer())
        engine.start()
        await engine.wait_loaded()
        try:
            return [o.outputs[0].text async for o in engine.generate("ab", SamplingParams(max_tokens=3), "r1")]
        finally:
            engine.shutdown()

    texts = asyncio.run(scenario())
    assert "".join(texts) == "cde" and all(texts)
