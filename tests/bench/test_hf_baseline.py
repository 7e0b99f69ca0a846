"""The naive transformers baseline server on a tiny random llama: OpenAI routes, streaming, one at a time."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from heron.bench.baselines.hf_server import HFBackend, create_app, load_backend


@pytest.fixture(scope="module")
def backend(tiny_llama_dir):
    return load_backend(str(tiny_llama_dir), "tiny", device="cpu")


def _post(backend: HFBackend, path: str, body: dict) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=create_app(backend))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(path, json=body)
    return asyncio.run(go())


def _events(resp: httpx.Response) -> list:
    data = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_models_and_health(backend):
    async def go():
        transport = httpx.ASGITransport(app=create_app(backend))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get("/health"), await client.get("/v1/models")
    health, models = asyncio.run(go())
    assert health.status_code == 200
    assert models.json()["data"][0]["id"] == "tiny" and models.json()["data"][0]["owned_by"] == "hf-baseline"


def test_completion_with_ignore_eos_gives_exactly_max_tokens(backend):
    resp = _post(backend, "/v1/completions", {"prompt": "w1 w2 w3", "max_tokens": 7, "temperature": 0,
                                               "ignore_eos": True})
    body = resp.json()
    assert resp.status_code == 200 and body["object"] == "text_completion"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}
    assert body["choices"][0]["finish_reason"] == "length"
    again = _post(backend, "/v1/completions", {"prompt": "w1 w2 w3", "max_tokens": 7, "temperature": 0,
                                                "ignore_eos": True}).json()
    assert again["choices"][0]["text"] == body["choices"][0]["text"]  # greedy is deterministic


def test_streaming_completion_matches_non_streaming_and_reports_usage(backend):
    req = {"prompt": "w4 w5", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    full = _post(backend, "/v1/completions", req).json()["choices"][0]["text"]
    events = _events(_post(backend, "/v1/completions", {**req, "stream": True,
                                                         "stream_options": {"include_usage": True}}))
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text == full
    assert events[-1]["usage"]["completion_tokens"] == 6
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"


def test_streaming_chat(backend):
    events = _events(_post(backend, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 4, "stream": True, "ignore_eos": True,
        "temperature": 0}))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert len(content.split()) == 4


def test_stop_string_cuts_the_output(backend):
    req = {"prompt": "w1 w2 w3", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    words = _post(backend, "/v1/completions", req).json()["choices"][0]["text"].split()
    body = _post(backend, "/v1/completions", {**req, "stop": [words[2]]}).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert words[2] not in body["choices"][0]["text"].split()[2:]
    assert body["choices"][0]["text"].split() == words[:words.index(words[2])]


@pytest.mark.parametrize("body", [{"prompt": 5}, {"prompt": "w1", "max_tokens": 0},
                                  {"prompt": "w1", "temperature": "hot"}, {"prompt": "w1 " * 130},
                                  {"prompt": "w1", "max_tokens": 500}, {"prompt": "w1", "n": 2}])
def test_bad_requests_get_400(backend, body):
    resp = _post(backend, "/v1/completions", body)
    assert resp.status_code == 400 and resp.json()["error"]["message"]


def test_generations_run_one_at_a_time(backend, monkeypatch):
    state = {"now": 0, "peak": 0}
    original = backend._generate

    def tracked(*args):
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        try:
            return original(*args)
        finally:
            state["now"] -= 1

    monkeypatch.setattr(backend, "_generate", tracked)

    async def go():
        transport = httpx.ASGITransport(app=create_app(backend))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            reqs = [client.post("/v1/completions", json={"prompt": f"w{i}", "max_tokens": 5, "stream": i % 2 == 0,
                                                         "ignore_eos": True}) for i in range(4)]
            return await asyncio.gather(*reqs)
    responses = asyncio.run(go())
    assert all(r.status_code == 200 for r in responses)
    assert state["peak"] == 1
