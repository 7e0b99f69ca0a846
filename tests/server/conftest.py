"""Fixtures for the server tests: the real app over a scripted fake core in its own process, served by uvicorn
in a thread; and the real server as a subprocess."""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from heron.config import EngineConfig
from heron.engine.async_engine import AsyncEngine
from heron.server.api_server import ServerOptions, build_app

from .chat_templates import QWEN3_STYLE
from .fake_core import FakeCore, FakeTokenizer

_REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class FakeServer:
    url: str
    engine: AsyncEngine


def start_fake_server(api_key: str | None = None, step_delay: float = 0.0, core_factory=None,
                      tokenizer: FakeTokenizer | None = None, wait: bool = True, **config
                      ) -> tuple[FakeServer, Callable[[], None]]:
    """Serve the real app over a FakeCore (in its own process, as a real core) on a free port, uvicorn in a
    background thread; returns (server, stop)."""
    factory = core_factory or functools.partial(FakeCore, step_delay=step_delay)
    tokenizer = tokenizer or FakeTokenizer()
    engine = AsyncEngine(EngineConfig(model="fake", **config), factory, lambda _: tokenizer)
    app = build_app(engine, ServerOptions(api_key=api_key, log_requests=True))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
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
        thread.join(30)

    return FakeServer(url, engine), stop


@pytest.fixture
def start_server():
    """``start_server(api_key=None, step_delay=0.0, core_factory=None, tokenizer=None, wait=True,
    **engine_config) -> (FakeServer, stop)``."""
    return start_fake_server


@pytest.fixture(scope="module")
def fake_server():
    server, stop = start_fake_server(step_delay=0.005)
    yield server
    stop()


def metric_values(url: str) -> dict[str, float]:
    """Every sample of /metrics, keyed by name plus its non-model labels."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


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

    def __enter__(self) -> ServerProcess:
        return self.wait_healthy()

    def __exit__(self, *exc) -> None:
        """Stop the server; it must exit cleanly (unless the block already failed)."""
        code = self.stop()
        if exc[0] is None:
            assert code == 0, self.log()

    def client(self, timeout: float = 60) -> openai.OpenAI:
        """The official OpenAI client on this server."""
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=timeout)

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


@pytest.fixture(scope="session")
def qwen3_style_server(tmp_path_factory):
    """A tiny random-weight Qwen3 served with a Qwen3-style chat template (``chat_templates.QWEN3_STYLE``),
    auto tool choice with the hermes parser, and the qwen3 reasoning parser; shared by the tool-calling and
    reasoning tests."""
    from helpers import build_tiny_model

    root = tmp_path_factory.mktemp("qwen3-style")
    model = build_tiny_model("qwen3", root / "model", max_position_embeddings=4096)
    template = root / "template.jinja"
    template.write_text(QWEN3_STYLE)
    with ServerProcess(model, "--served-model-name", "tiny", "--chat-template", str(template),
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                        log_path=root / "server.log", kind="tiny") as proc:
        yield proc
