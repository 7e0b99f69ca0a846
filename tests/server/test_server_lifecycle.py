"""Server process lifecycle: start-up errors, API key, backpressure, request logs off, SIGTERM mid-stream, a
killed core process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from heron.server.cli import main

from .conftest import _REPO


def run_entrypoint(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "heron.entrypoints.openai.api_server", *flags],
                          capture_output=True, text=True, timeout=120, cwd=_REPO)


@pytest.mark.parametrize("flags,expected", [
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be at least 1"),
    (["--speculative-model", "draft"], "needs num_speculative_tokens"),
    (["--block-size", "3"], "--block-size must be a positive power of two"),
])
def test_unbuilt_or_invalid_flags_fail_at_start(flags, expected, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--model", "whatever", "--port", "1", *flags])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err and len(err.splitlines()) == 1


def test_model_that_fails_to_load_exits_1_with_message(tmp_path):
    proc = run_entrypoint("--model", str(tmp_path / "no-such-model"), "--host", "127.0.0.1", "--port", "0")
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "no-such-model" in proc.stderr


def test_key_backpressure_quiet_logs_and_sigterm(launch_server, tiny_model_dir):
    server = launch_server(tiny_model_dir("llama"), "--max-num-seqs", "1", "--max-waiting-requests", "1",
                           "--disable-log-requests", "--shutdown-timeout", "2",
                           env={"HERON_API_KEY": "sekret"}).wait_healthy()
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}).status_code == 401
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sekret", max_retries=0, timeout=60)

    async def one() -> int:
        try:
            await client.completions.create(model=str(tiny_model_dir("llama")), prompt="Hello there",
                                            max_tokens=60, temperature=0, extra_body={"ignore_eos": True})
            return 200
        except openai.APIStatusError as e:
            assert e.status_code != 503 or e.body["code"] == "overloaded"
            return e.status_code

    async def burst() -> list[int]:
        return await asyncio.gather(*(one() for _ in range(8)))

    statuses = asyncio.run(burst())
    assert 200 in statuses and 503 in statuses and set(statuses) <= {200, 503}
    assert " finished: " not in server.log()

    headers = {"Authorization": "Bearer sekret"}
    body = {"prompt": "A long story", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]  # finished within --shutdown-timeout, or ended by it
    assert rest[-1] == "data: [DONE]"
    start = time.time()
    assert server.proc.wait(30) == 0, server.log()
    assert time.time() - start < 30
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health")


def test_core_process_killed_mid_stream(launch_server, tiny_model_dir):
    server = launch_server(tiny_model_dir("llama")).wait_healthy()
    pid = int(re.search(r"engine core process started \(pid (\d+)\)", server.log()).group(1))
    body = {"prompt": "A long story", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        os.kill(pid, signal.SIGKILL)
        rest = [line for line in lines if line]
    assert json.loads(rest[-2][len("data: "):])["error"]["code"] == "engine_dead"
    assert rest[-1] == "data: [DONE]"
    deadline = time.time() + 5
    while httpx.get(server.url + "/health").status_code != 503:
        assert time.time() < deadline
        time.sleep(0.05)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead"
    assert f"the engine core process (pid {pid}) died (killed by SIGKILL)" in server.log()
    assert server.stop() == 0, server.log()


def test_serve_takes_model_positionally_or_by_flag():
    from heron.cli import build_parser
    from heron.errors import ConfigError
    from heron.server.cli import config_from_args

    parser = build_parser()
    assert config_from_args(parser.parse_args(["serve", "/models/a", "--port", "9"])).model == "/models/a"
    assert config_from_args(parser.parse_args(["serve", "--model", "/models/b"])).model == "/models/b"
    args = parser.parse_args(["serve", "--api-key", "k", "--disable-log-requests", "--max-num-seqs", "3"])
    assert (args.api_key, args.disable_log_requests, config_from_args(args).max_num_seqs) == ("k", True, 3)
    assert args.port == 8000 and args.host == "0.0.0.0"
    with pytest.raises(ConfigError, match="disagree"):
        config_from_args(parser.parse_args(["serve", "/models/a", "--model", "/models/b"]))
