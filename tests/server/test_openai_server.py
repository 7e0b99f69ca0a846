"""The real server process on 127.0.0.1, driven with the official openai client (tiny model; SmolLM2 marked)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import ServerProcess

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.smollm2)])
def server(request, tiny_model_dir, tmp_path_factory):
    if request.param == "tiny":
        model = tiny_model_dir("llama")
    else:
        model = request.getfixturevalue("smollm2_path")
    with ServerProcess(model, "--max-num-seqs", "64", "--max-model-len", "512", "--served-model-name",
                        "test-model", log_path=tmp_path_factory.mktemp("server") / "server.log", kind=request.param) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def metrics(server: ServerProcess) -> dict[str, float]:
    """Every sample of /metrics, keyed by name plus its non-model labels."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def num_tokens(server: ServerProcess, text: str) -> int:
    return httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["count"]


def test_completion_stream_matches_whole_and_usage(server, client):
    prompt = "The quick brown fox"
    whole = client.completions.create(model="test-model", prompt=prompt, max_tokens=12, **GREEDY)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == num_tokens(server, prompt)
    assert whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    chunks = list(client.completions.create(model="test-model", prompt=prompt, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_chat_stream_matches_whole_and_usage(server, client):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Say hello."}]
    # both requests below find the prompt in the prefix cache, as this one leaves it: in bfloat16 a prompt's
    # first run (one long chunk through SDPA) and its cached replay (the tail through the paged kernel) can
    # differ in their last bits, an open issue measured by benchmarks/bench_batch_invariance.py
    client.chat.completions.create(model="test-model", messages=messages, max_tokens=1, **GREEDY)
    whole = client.chat.completions.create(model="test-model", messages=messages, max_tokens=10, **GREEDY)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 10
    template = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    assert whole.usage.prompt_tokens == template["count"]
    chunks = list(client.chat.completions.create(model="test-model", messages=messages, max_tokens=10,
                                                 stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_logprobs_and_n(server, client):
    r = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, n=2, logprobs=True, top_logprobs=2, temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert len(c.logprobs.content) == 4
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in c.logprobs.content)
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)


def test_models_and_version(server, client):
    assert [m.id for m in client.models.list().data] == ["test-model"]
    assert httpx.get(server.url + "/version").json()["version"]


def test_32_concurrent_streams_are_batched(server):
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)

    async def one(i: int) -> tuple[str, int]:
        text, usage = "", None
        stream = await aclient.completions.create(model="test-model", prompt=f"Hello number {i}", max_tokens=16,
                                                  stream=True, stream_options={"include_usage": True}, **GREEDY)
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def run_all():
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await aclient.close()

    results = asyncio.run(run_all())
    assert [n for _, n in results] == [16] * 32
    assert metrics(server)["heron:max_num_requests_running_seen"] > 1


def test_counters_move(server, client):
    before = metrics(server)
    prompt = "Counting tokens for metrics"
    client.completions.create(model="test-model", prompt=prompt, max_tokens=5, **GREEDY)
    after = metrics(server)
    assert after["heron:generation_tokens_total"] - before["heron:generation_tokens_total"] == 5
    computed = after["heron:prompt_tokens_total"] - before["heron:prompt_tokens_total"]
    cached = after["heron:prefix_cache_hits_total"] - before["heron:prefix_cache_hits_total"]
    assert computed + cached >= num_tokens(server, prompt) > 0
    key = "heron:request_success_total{finished_reason=length}"
    assert after[key] - before[key] == 1
    e2e = "heron:e2e_request_latency_seconds_count"
    assert after[e2e] - before[e2e] == 1
    assert after["heron:num_requests_running"] == 0 and after["heron:kv_cache_usage_perc"] == 0


def test_disconnecting_10_streams_frees_kv_cache(server):
    async def start_and_leave(i: int) -> int:
        body = {"model": "test-model", "prompt": f"Abandoned stream {i}", "max_tokens": 400, "stream": True,
                "ignore_eos": True, "temperature": 0}
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 3:
                        return seen
        return seen

    async def run_all():
        return await asyncio.gather(*(start_and_leave(i) for i in range(10)))

    assert asyncio.run(run_all()) == [3] * 10
    deadline = time.time() + 10
    while time.time() < deadline:
        m = metrics(server)
        if m["heron:kv_cache_usage_perc"] == 0 and m["heron:num_requests_running"] == 0:
            break
        time.sleep(0.05)
    assert m["heron:kv_cache_usage_perc"] == 0 and m["heron:num_requests_running"] == 0
    assert m["heron:request_success_total{finished_reason=abort}"] >= 10


def test_request_log_lines(server, client):
    r = client.completions.create(model="test-model", prompt="log me", max_tokens=3, **GREEDY)
    time.sleep(0.2)
    line = next(ln for ln in server.log().splitlines() if r.id in ln and "finished" in ln)
    assert "output_tokens=3" in line and "latency=" in line and "prompt_tokens=" in line


LONG = "word " * 5000
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
# (endpoint, body (dict, or raw bytes), expected status, expected param or None)
BAD_INPUTS = [
    (COMP, {"model": "test-model"}, 400, "prompt"),
    (COMP, {"model": "test-model", "prompt": 123}, 400, "prompt"),
    (COMP, {"model": "test-model", "prompt": ""}, 400, "prompt"),
    (COMP, {"model": "test-model", "prompt": [10**9]}, 400, "prompt"),
    (COMP, {"model": "test-model", "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    (COMP, {"model": "test-model", "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    (COMP, {"model": "test-model", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (COMP, {"model": "test-model", "prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
    (COMP, {"model": "test-model", "prompt": LONG}, 400, "prompt"),
    (COMP, {"model": "test-model", "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    (COMP, {"model": "test-model", "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    (COMP, {"model": "test-model", "prompt": "hi", "top_p": 2}, 400, "top_p"),
    (COMP, {"model": "test-model", "prompt": "hi", "n": 0}, 400, "n"),
    (COMP, {"model": "test-model", "prompt": "hi", "n": 100000}, 400, "n"),
    (COMP, {"model": "test-model", "prompt": "hi", "logprobs": 100}, 400, "logprobs"),
    (COMP, {"model": "test-model", "prompt": "hi", "suffix": "end"}, 400, "suffix"),
    (COMP, {"model": "test-model", "prompt": "hi", "presence_penalty": 5}, 400, "presence_penalty"),
    (COMP, {"model": "test-model", "prompt": "hi", "stop": [""]}, 400, "stop"),
    (COMP, {"model": "test-model", "prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (COMP, {"model": "test-model", "prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    (COMP, {"model": "test-model", "prompt": "hi", "seed": "abc"}, 400, "seed"),
    (COMP, {"model": "test-model", "prompt": "hi", "stream": "maybe"}, 400, "stream"),
    (COMP, {"model": "test-model", "prompt": "hi", "min_tokens": 9, "max_tokens": 2}, 400, "min_tokens"),
    (COMP, {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    (COMP, b'{"model": "test-model", "prompt": ', 400, None),
    (COMP, b"[1, 2, 3]", 400, None),
    (CHAT, {"model": "test-model"}, 400, "messages"),
    (CHAT, {"model": "test-model", "messages": []}, 400, "messages"),
    (CHAT, {"model": "test-model", "messages": "hi"}, 400, "messages"),
    (CHAT, {"model": "test-model", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    (CHAT, {"model": "test-model", "messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    (CHAT, {"model": "test-model", "messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    (CHAT, {"model": "test-model", "messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"model": "test-model", "messages": USER, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    (CHAT, {"model": "test-model", "messages": USER, "response_format": {"type": "xml"}}, 400,
     "response_format.type"),
    (CHAT, {"model": "test-model", "messages": [{"role": "user", "content": LONG}]}, 400, "prompt"),
    (CHAT, {"model": "nope", "messages": USER}, 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_INPUTS)
def test_bad_input_gets_openai_error(server, path, body, status, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = httpx.post(server.url + path, timeout=30, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["message"] and "Traceback" not in r.text and "errors.pydantic.dev" not in r.text
    if "max_tokens" in body if isinstance(body, dict) else False:
        assert str(body["max_tokens"]) in error["message"] or body["max_tokens"] < 1


def test_server_still_serves_after_bad_inputs(server, client):
    for path, body, _, _ in BAD_INPUTS[:5]:
        httpx.post(server.url + path, json=body)
    r = client.completions.create(model="test-model", prompt="still alive", max_tokens=2, **GREEDY)
    assert r.usage.completion_tokens == 2
    assert httpx.get(server.url + "/health").status_code == 200


def test_context_length_error_says_the_numbers(server, client):
    max_len = httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="test-model", prompt="hi", max_tokens=max_len)
    assert str(max_len) in e.value.message and e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="test-model", prompt=LONG)
    assert str(max_len) in e.value.message


def test_structured_outputs(server, client):
    r = client.chat.completions.create(model="test-model", messages=USER, max_tokens=20, temperature=1.0,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    schema = {"type": "string", "enum": ["red", "green"]}
    r = client.chat.completions.create(model="test-model", messages=USER, max_tokens=20, response_format={
        "type": "json_schema", "json_schema": {"name": "color", "schema": schema}})
    assert json.loads(r.choices[0].message.content) in ("red", "green")


def test_embeddings_need_a_pooling_server(server, client):
    for path in ("/v1/embeddings", "/pooling"):
        r = httpx.post(server.url + path, json={"model": "test-model", "input": "hi"})
        assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"], r.text
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client.embeddings.create(model="test-model", input="hi")
