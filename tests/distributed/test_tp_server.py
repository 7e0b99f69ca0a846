"""The real server with --tensor-parallel-size 2: TP=1's greedy text, and a killed rank fails the engine (errors to
in-flight streams, /health 503 within seconds) instead of hanging it."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import httpx
import pytest

from tests.server.conftest import ServerProcess

pytestmark = pytest.mark.slow


def rank_pid(server: ServerProcess) -> int:
    return int(re.search(r"tensor-parallel rank 1 of 2 ready \(pid (\d+)", server.log()).group(1))


def wait_unhealthy(server: ServerProcess, seconds: float = 10) -> None:
    deadline = time.time() + seconds
    while httpx.get(server.url + "/health").status_code != 503:
        assert time.time() < deadline, server.log()
        time.sleep(0.05)


def test_tp2_server_answers_as_tp1(tiny_model_dir, tmp_path):
    body = {"model": "m", "prompt": "Once upon a time there was", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    chat = {"model": "m", "messages": [{"role": "user", "content": "Hello, world!"}], "max_tokens": 16,
            "temperature": 0}
    answers = []
    for tp in ("1", "2"):
        with ServerProcess(tiny_model_dir("qwen2"), "--served-model-name", "m", "--dtype", "float32",
                           "--tensor-parallel-size", tp, log_path=tmp_path / f"tp{tp}.log") as s:
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
            c = httpx.post(s.url + "/v1/chat/completions", json=chat, timeout=60)
            assert r.status_code == 200 and c.status_code == 200, r.text + c.text
            answers.append((r.json()["choices"][0]["text"], c.json()["choices"][0]["message"]["content"]))
    assert answers[0] == answers[1]


def test_rank_killed_mid_stream_fails_the_engine(tiny_model_dir, tmp_path):
    server = ServerProcess(tiny_model_dir("llama"), "--tensor-parallel-size", "2", "--dtype", "float32",
                           log_path=tmp_path / "s.log").wait_healthy()
    try:
        pid = rank_pid(server)
        body = {"prompt": "A long story", "max_tokens": 480, "ignore_eos": True, "stream": True}
        start = time.time()
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(pid, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert time.time() - start < 15
        assert "error" in json.loads(rest[-2][len("data: "):])
        assert rest[-1] == "data: [DONE]"
        wait_unhealthy(server)
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}).status_code >= 500
        assert f"tensor-parallel rank 1 (pid {pid}) was killed by SIGKILL" in server.log()
    finally:
        server.stop()


def test_rank_killed_while_idle_makes_health_fail(tiny_model_dir, tmp_path):
    server = ServerProcess(tiny_model_dir("llama"), "--tensor-parallel-size", "2", "--dtype", "float32",
                           log_path=tmp_path / "s.log").wait_healthy()
    try:
        os.kill(rank_pid(server), signal.SIGKILL)
        wait_unhealthy(server, seconds=5)
    finally:
        server.stop()


def test_a_size_the_model_cannot_take_stops_the_server_with_one_message(tiny_model_dir, tmp_path):
    proc = ServerProcess(tiny_model_dir("llama"), "--tensor-parallel-size", "3", log_path=tmp_path / "bad.log")
    assert proc.proc.wait(120) != 0
    assert "--tensor-parallel-size 3 does not split this model: it has 4 attention heads" in proc.log()
    assert "Traceback" not in proc.log()
