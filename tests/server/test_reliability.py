"""Hostile clients (issue 17): bad inputs get OpenAI 400s and leave nothing behind, a huge prompt does not stall
others, SIGTERM drains, a 500 is logged once, and a mixed soak leaks no request and no KV block."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import signal
import threading
import time

import httpx
import pytest
from helpers import build_tiny_model

from heron.server.completions import Completions

from .conftest import ServerProcess, metric_values
from .fake_core import FakeTokenizer

COMP, CHAT, TOKENIZE, DETOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
BODY_LIMIT = 24 * 1024**2
LONE = "\ud800"  # a lone surrogate: valid in JSON, not in UTF-8
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with ServerProcess(tiny_model_dir("llama"), "--max-model-len", "512", "--served-model-name", "test-model",
                        "--max-request-body", "24MiB", log_path=tmp_path_factory.mktemp("server") / "server.log") as proc:
        yield proc


def post_json(url: str, body: dict | bytes, timeout: float = 30) -> httpx.Response:
    """POST ``body`` (a dict, serialised with lone surrogates as escapes, or raw JSON bytes)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url, content=content, headers={"content-type": "application/json"}, timeout=timeout)


def wait_idle(url: str, timeout: float = 10) -> dict[str, float]:
    """/metrics once no request runs or waits and no KV block is used (fails after ``timeout`` seconds)."""
    deadline = time.time() + timeout
    while True:
        m = metric_values(url)
        idle = (m["heron:num_requests_running"], m["heron:num_requests_waiting"], m["heron:kv_cache_usage_perc"])
        if idle == (0, 0, 0):
            return m
        assert time.time() < deadline, f"not idle: running, waiting, kv usage = {idle}"
        time.sleep(0.05)


# (path, body, status, param, code): code None means the HTTP status itself
HOSTILE = [
    (COMP, {"prompt": "hi", "seed": 2**64}, 400, "seed", None),
    (COMP, {"prompt": "hi", "seed": -2**63 - 1}, 400, "seed", None),
    (CHAT, {"messages": [{"role": "user", "content": LONE}]}, 400, "messages.0.content", None),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a" + LONE}]}]}, 400,
     "messages.0.content.0.text", None),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "name": LONE}]}, 400, "messages.0.name", None),
    (COMP, {"prompt": LONE}, 400, "prompt", None),
    (COMP, {"prompt": ["fine", LONE]}, 400, "prompt", None),
    (COMP, {"prompt": "hi", "bad_words": [LONE]}, 400, "bad_words", None),
    (COMP, {"prompt": "hi", "stop": LONE}, 400, "stop", None),
    (COMP, {"prompt": "hi", "model": LONE}, 400, "model", None),
    (COMP, {"prompt": "hi", "guided_json": {"enum": [LONE]}}, 400, "guided_json", None),
    (COMP, {"prompt": "hi", "guided_json": '{"enum": ["\\ud800"]}'}, 400, "guided_json", None),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"enum": [LONE]}}}}, 400, "response_format.json_schema.schema", None),
    (TOKENIZE, {"prompt": LONE}, 400, "prompt", None),
    (COMP, {"prompt": "hi", "logit_bias": {"100": "NaN"}}, 400, "logit_bias.100", None),
    (COMP, b'{"prompt": "hi", "logit_bias": {"100": NaN}}', 400, "logit_bias.100", None),
    (COMP, b'{"prompt": "hi", "logit_bias": {"100": 1e400}}', 400, "logit_bias.100", None),
    (COMP, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature", None),
    (COMP, {"prompt": "hi", "temperature": "Infinity"}, 400, "temperature", None),
    (COMP, {"prompt": "hi", "top_p": "NaN"}, 400, "top_p", None),
    (COMP, {"prompt": "hi", "presence_penalty": "-Infinity"}, 400, "presence_penalty", None),
    (COMP, {"prompt": "hi", "frequency_penalty": "NaN"}, 400, "frequency_penalty", None),
    (CHAT, {"messages": USER, "repetition_penalty": "Infinity"}, 400, "repetition_penalty", None),
    (COMP, {"prompt": "hi", "n": 2**64}, 400, "n", None),
    (COMP, {"prompt": "hi", "max_tokens": 10**30}, 400, "max_tokens", None),
    (CHAT, {"messages": USER, "max_completion_tokens": -2**70}, 400, "max_completion_tokens", None),
    (COMP, {"prompt": "hi", "priority": 2**63}, 400, "priority", None),
    (COMP, {"prompt": "hi", "top_k": 2**63}, 400, "top_k", None),
    (COMP, {"prompt": "hi", "min_tokens": 2**63}, 400, "min_tokens", None),
    (COMP, {"prompt": [2**63]}, 400, "prompt", None),
    (COMP, {"prompt": [[1, 2], [2**64]]}, 400, "prompt", None),
    (COMP, {"prompt": [5000]}, 400, "prompt", None),
    (COMP, {"prompt": "hi", "stop_token_ids": [2**64]}, 400, "stop_token_ids.0", None),
    (COMP, {"prompt": "hi", "allowed_token_ids": [-2**64]}, 400, "allowed_token_ids.0", None),
    (COMP, {"prompt": "hi", "logit_bias": {"1" * 5000: 1}}, 400, "logit_bias", None),
    (DETOKENIZE, {"tokens": [2**64]}, 400, "tokens.0", None),
    (DETOKENIZE, {"tokens": [1] * 513}, 400, "tokens", None),
    (COMP, {"prompt": "word " * 20_000}, 400, "prompt", "context_length_exceeded"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 20_000}]}, 400, "prompt", "context_length_exceeded"),
    (TOKENIZE, {"prompt": "word " * 20_000}, 400, "prompt", "context_length_exceeded"),
    (COMP, {"prompt": "a" * (BODY_LIMIT + 1)}, 413, None, None),
]


def test_hostile_inputs_get_openai_errors_and_leave_nothing_behind(server):
    failures = []
    for path, body, status, param, code in HOSTILE:
        r = post_json(server.url + path, body)
        shown = (body[:80] if isinstance(body, bytes) else json.dumps(body)[:80])
        if r.status_code != status:
            failures.append(f"{path} {shown}: {r.status_code} {r.text[:200]}")
            continue
        error = r.json()["error"]
        if set(error) != {"message", "type", "param", "code"} or (error["param"], error["code"]) != (
                param, code or status) or not error["message"] or "Traceback" in r.text:
            failures.append(f"{path} {shown}: {error}")
    assert not failures, "\n".join(failures)
    too_long = post_json(server.url + COMP, {"prompt": "word " * 20_000}).json()["error"]["message"]
    assert "100000 characters" in too_long and "512 tokens" in too_long  # names the prompt and the limit
    assert httpx.get(server.url + "/health").status_code == 200
    r = post_json(server.url + COMP, {"prompt": "still alive", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    wait_idle(server.url)
    assert "Traceback" not in server.log() and "Exception in ASGI application" not in server.log()


def test_largest_seed_with_n_2(server):
    body = {"prompt": "hi", "seed": 2**64 - 1, "n": 2, "max_tokens": 4, "temperature": 1.0, "ignore_eos": True}
    first, again = (post_json(server.url + COMP, body) for _ in range(2))
    assert first.status_code == 200, first.text
    assert [c["index"] for c in first.json()["choices"]] == [0, 1]
    assert [c["text"] for c in first.json()["choices"]] == [c["text"] for c in again.json()["choices"]]
    assert httpx.get(server.url + "/health").status_code == 200


def test_huge_prompt_is_refused_fast_without_stalling_others(server):
    huge = {"prompt": "a" * 20_000_000, "max_tokens": 1}
    refused: list[tuple[int, float]] = []

    def send_huge() -> None:
        for path, body in ((COMP, huge), (CHAT, {"messages": [{"role": "user", "content": huge["prompt"]}]})):
            start = time.time()
            r = post_json(server.url + path, body, timeout=60)
            refused.append((r.status_code, time.time() - start))

    latencies = []
    sender = threading.Thread(target=send_huge)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        sender.start()
        while sender.is_alive() or not latencies:
            start = time.time()
            r = client.post(COMP, json={"prompt": "hi", "max_tokens": 1})
            latencies.append(time.time() - start)
            assert r.status_code == 200
    sender.join()
    assert [status for status, _ in refused] == [400, 400]
    assert max(elapsed for _, elapsed in refused) < 3, refused
    assert max(latencies) < 1.0, latencies


def test_sigterm_drains_streams_then_exits_0(launch_server, tmp_path):
    timeout = 1.0  # the short streams finish within it, the long ones (4,000 tokens) cannot
    model = build_tiny_model("llama", tmp_path / "model", max_position_embeddings=4096)
    server = launch_server(model, "--shutdown-timeout", str(timeout)).wait_healthy()
    first_lines = threading.Semaphore(0)
    events: dict[int, list[str]] = {}

    def stream(i: int) -> None:
        path, body = (COMP, {"prompt": "Once upon a time"}) if i % 2 else (CHAT, {"messages": USER})
        body |= {"stream": True, "max_tokens": 4 if i < 3 else 4000, "ignore_eos": True}
        lines = events[i] = []
        with httpx.stream("POST", server.url + path, json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    if len(lines) == 1:
                        first_lines.release()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for _ in threads:
        assert first_lines.acquire(timeout=30)
    start = time.time()
    server.proc.send_signal(signal.SIGTERM)
    while httpx.get(server.url + "/health").status_code == 200:
        assert time.time() - start < 1
        time.sleep(0.02)
    r = httpx.post(server.url + COMP, json={"prompt": "hi"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    for t in threads:
        t.join(30)
    assert server.proc.wait(timeout + 5) == 0, server.log()
    assert time.time() - start < timeout + 2
    endings = []
    for i, lines in sorted(events.items()):
        assert lines[-1] == "data: [DONE]", (i, lines[-3:])
        last = json.loads(lines[-2][len("data: "):])
        if "error" in last:
            endings.append(last["error"]["code"])
        else:
            endings.append(last["choices"][-1]["finish_reason"])
    assert set(endings) <= {"length", "shutting_down"} and "length" in endings and "shutting_down" in endings
    log = server.log()
    assert log.count("SIGTERM received") == 1 and "Traceback" not in log and "Cancel" not in log


class ExplodingTokenizer(FakeTokenizer):
    """A FakeTokenizer with a bug: it raises on a prompt that holds "explode"."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if "explode" in text:
            raise RuntimeError("tokenizer bug")
        return super().encode(text, add_special_tokens)


def test_internal_error_is_logged_once_with_the_request_id(start_server, caplog, monkeypatch):
    server, stop = start_server(tokenizer=ExplodingTokenizer())
    uvicorn_log = logging.getLogger("uvicorn.error")  # does not propagate to caplog's root handler
    uvicorn_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO):
            r = httpx.post(server.url + COMP, json={"prompt": "explode"})
            assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
            assert "tokenizer bug" not in r.text

            def broken_chunk(*args, **kwargs):
                raise RuntimeError("chunk bug")

            monkeypatch.setattr(Completions, "_chunk", broken_chunk)
            with httpx.stream("POST", server.url + COMP, json={"prompt": "a", "stream": True}) as s:
                lines = [line for line in s.iter_lines() if line]
        assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "internal_error"
        assert lines[-1] == "data: [DONE]"
    finally:
        stop()
        uvicorn_log.removeHandler(caplog.handler)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.name for r in errors] == ["heron.server", "heron.server"], [r.getMessage() for r in errors]
    for record, bug in zip(errors, ("tokenizer bug", "chunk bug"), strict=True):
        assert re.fullmatch(r"request cmpl-[0-9a-f]{32} failed with an internal error", record.getMessage())
        assert record.exc_info is not None and str(record.exc_info[1]) == bug


SCHEMAS = [{"type": "string", "enum": ["red", "green", "blue"]},
           {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}]


def _soak_request(rng: random.Random) -> tuple[str, dict]:
    """A random completion or chat request: n up to 3, stop strings, logprobs, some JSON schemas."""
    body: dict = {"max_tokens": rng.randint(1, 24), "n": rng.choice([1, 1, 2, 3]),
                  "temperature": rng.choice([0, 0.8, 1.0]), "stream": rng.random() < 0.5}
    if rng.random() < 0.3:
        body["stop"] = rng.sample(["e", "th", " a", "o"], 2)
    if rng.random() < 0.05:
        schema = rng.choice(SCHEMAS)
        body |= {"n": 1, "max_tokens": 40, "response_format": {"type": "json_schema",
                                                                 "json_schema": {"name": "s", "schema": schema}}}
        return CHAT, body | {"messages": USER}
    if rng.random() < 0.5:
        if rng.random() < 0.3:
            body |= {"logprobs": True, "top_logprobs": 2}
        return CHAT, body | {"messages": [{"role": "user", "content": rng.choice(["Hi", "Tell a story", "2+2"])}]}
    if rng.random() < 0.3:
        body["logprobs"] = 2
    return COMP, body | {"prompt": rng.choice(["The quick brown fox", "Hello", "def add(a, b):"])}


async def _soak_one(client: httpx.AsyncClient, path: str, body: dict, abort_after: float | None) -> str:
    """Send one request; returns "ok", "aborted" (the client left on purpose) or what went wrong."""
    async def run() -> str:
        if not body["stream"]:
            r = await client.post(path, json=body)
            if r.status_code != 200:
                return f"{r.status_code}: {r.text[:200]}"
            choices = r.json()["choices"]
            reasons = sorted(c["finish_reason"] for c in choices)
            return "ok" if len(choices) == body["n"] and set(reasons) <= {"stop", "length"} else f"bad {reasons}"
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                return f"{r.status_code}: {(await r.aread())[:200]}"
            lines = [line async for line in r.aiter_lines() if line]
        if lines[-1] != "data: [DONE]":
            return f"no [DONE]: {lines[-2:]}"
        chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
        if any("error" in c for c in chunks):
            return f"error event: {chunks[-1]}"
        finished = {c["index"] for chunk in chunks for c in chunk["choices"] if c.get("finish_reason")}
        return "ok" if finished == set(range(body["n"])) else f"unfinished choices: {finished}"

    if abort_after is None:
        return await run()
    try:
        return await asyncio.wait_for(run(), abort_after)
    except TimeoutError:
        return "aborted"


def test_soak_mixed_requests_leaks_nothing(server):
    rng = random.Random(17)
    plan = [(*_soak_request(rng), rng.uniform(0.01, 0.3) if rng.random() < 0.15 else None) for _ in range(300)]

    async def soak() -> list[str]:
        limit = asyncio.Semaphore(16)
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     limits=httpx.Limits(max_connections=16)) as client:
            async def one(path: str, body: dict, abort_after: float | None) -> str:
                async with limit:
                    return await _soak_one(client, path, body, abort_after)

            return await asyncio.gather(*(one(*p) for p in plan))

    start = time.time()
    outcomes = asyncio.run(asyncio.wait_for(soak(), 120))
    elapsed = time.time() - start
    errors = [(plan[i][:2], o) for i, o in enumerate(outcomes) if o not in ("ok", "aborted")]
    assert not errors, errors[:5]
    assert outcomes.count("ok") >= 200 and elapsed < 90, (outcomes.count("ok"), elapsed)
    assert outcomes.count("aborted") > 0
    wait_idle(server.url)
    assert httpx.get(server.url + "/health").status_code == 200
