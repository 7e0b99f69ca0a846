"""Fixtures for the server tests: a scripted fake engine behind the real app, served by uvicorn in a thread."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from heron.config import EngineConfig
from heron.engine.async_engine import AsyncEngine
from heron.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from heron.errors import InvalidRequestError, PromptTooLongError
from heron.sampling.sampler import TokenLogprobs
from heron.server.api_server import ServerOptions, build_app

_REPO = Path(__file__).resolve().parents[2]


class FakeTokenizer:
    """One character per token: token t is the letter chr(97 + t % 26)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [(ord(c) - 97) % 26 for c in text]

    def decode(self, ids: list[int], **kw) -> str:
        return "".join(chr(97 + t % 26) for t in ids)


@dataclass
class _FakeRequest:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: object
    outputs: list[list[int]]
    metrics: RequestMetrics
    finish: list[str | None]


class FakeEngine:
    """The Engine interface, scripted: each step appends the next letter to every choice of every request.

    A prompt containing "boom" makes ``step()`` raise; ``step_delay`` slows steps down.
    """

    model_name = "fake"
    max_model_len = 64
    vocab_size = 26

    def __init__(self, config: EngineConfig, step_delay: float = 0.0) -> None:
        self.config = config
        self.tokenizer = FakeTokenizer()
        self.requests: dict[str, _FakeRequest] = {}
        self.step_delay = step_delay
        self.aborted: list[str] = []
        self.max_running = 0
        self.finished_by_reason: dict[str, int] = {}

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return "".join(m["content"] for m in messages)

    def add_request(self, request_id, prompt, params, priority=0, arrival_time=None) -> None:
        ids = self.encode(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(f"prompt has {len(ids)} tokens, limit {self.max_model_len}", param="prompt")
        self.requests[request_id] = _FakeRequest(request_id, prompt if isinstance(prompt, str) else None, ids,
                                                 params, [[] for _ in range(params.n)],
                                                 RequestMetrics(time.time()), [None] * params.n)

    def abort_request(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_delay)
        if any("boom" in self.tokenizer.decode(r.prompt_ids) for r in self.requests.values()):
            raise RuntimeError("scripted failure")
        self.max_running = max(self.max_running, len(self.requests))
        now, outputs = time.time(), []
        for req in list(self.requests.values()):
            req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or now
            req.metrics.first_token_time = req.metrics.first_token_time or now
            req.metrics.last_token_time = now
            for i, out in enumerate(req.outputs):
                if req.finish[i] is None:
                    out.append((req.prompt_ids[-1] + len(out) + 1 + i) % 26)
                    limit = req.params.max_tokens or self.max_model_len - len(req.prompt_ids)
                    if len(out) >= limit:
                        req.finish[i] = "length"
            finished = all(req.finish)
            if finished:
                req.metrics.finished_time = now
                del self.requests[req.request_id]
                self.finished_by_reason["length"] = self.finished_by_reason.get("length", 0) + 1
            outputs.append(self._output(req, finished))
        return outputs

    def _output(self, req: _FakeRequest, finished: bool) -> RequestOutput:
        want = req.params.logprobs
        outs = [CompletionOutput(i, self.tokenizer.decode(ids), list(ids),
                                 logprobs=None if want is None else
                                 [TokenLogprobs(t, -0.5, 1, [(t, -0.5)] * want) for t in ids],
                                 finish_reason=req.finish[i]) for i, ids in enumerate(req.outputs)]
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids, outs, finished, req.metrics)

    def stats(self) -> EngineStats:
        used = sum(len(r.prompt_ids) + len(r.outputs[0]) for r in self.requests.values())
        return EngineStats(num_running=len(self.requests), kv_cache_usage=min(1.0, used / 1000),
                           max_running_seen=self.max_running, generation_tokens=0,
                           finished_by_reason=dict(self.finished_by_reason))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class FakeServer:
    url: str
    engine: AsyncEngine

    @property
    def fake(self) -> FakeEngine:
        return self.engine._engine


def start_fake_server(api_key: str | None = None, step_delay: float = 0.0, engine_factory=None,
                      wait: bool = True, **config) -> tuple[FakeServer, object]:
    """Serve the real app over a FakeEngine on a free port in a background thread; returns (server, stop)."""
    factory = engine_factory or (lambda c: FakeEngine(c, step_delay))
    engine = AsyncEngine(EngineConfig(model="fake", **config), factory)
    app = build_app(engine, ServerOptions(api_key=api_key, log_requests=True))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health").status_code == 200 or not wait:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.02)
    else:
        raise RuntimeError("fake server did not come up")

    def stop() -> None:
        server.should_exit = True
        thread.join(10)

    return FakeServer(url, engine), stop


@pytest.fixture
def start_server():
    """``start_server(api_key=None, step_delay=0.0, **engine_config) -> (FakeServer, stop)``."""
    return start_fake_server


@pytest.fixture
def fake_engine_cls():
    return FakeEngine


@pytest.fixture(scope="module")
def fake_server():
    server, stop = start_fake_server(step_delay=0.005)
    yield server
    stop()


class ServerProcess:
    """``python -m heron.entrypoints.openai.api_server`` in a subprocess on 127.0.0.1, logging to a file."""

    def __init__(self, model: str | Path, *flags: str, log_path: Path, env: dict | None = None,
                 kind: str = "") -> None:
        self.kind = kind
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "heron.entrypoints.openai.api_server", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(self.port), *flags]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=_REPO,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})

    def wait_healthy(self, timeout: float = 180) -> ServerProcess:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM the server and return its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def launch_server(tmp_path):
    """``launch_server(model, *flags) -> ServerProcess`` (not yet healthy); every one is stopped at teardown."""
    servers: list[ServerProcess] = []

    def launch(model: str | Path, *flags: str, env: dict | None = None) -> ServerProcess:
        servers.append(ServerProcess(model, *flags, log_path=tmp_path / f"server{len(servers)}.log", env=env))
        return servers[-1]

    yield launch
    for s in servers:
        s.stop()
