"""A fake OpenAI-compatible streaming server with known timing, run in a background thread for the tests."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class FakeConfig:
    """Timing and faults. ``faults`` maps the n-th request the server receives (0-based) to a fault:
    ``"500"`` (HTTP 500), ``"drop"`` (connection closed mid-stream) or ``"hang"`` (never answers in time)."""

    ttft_s: float = 0.2
    itl_s: float = 0.03
    send_usage: bool = True
    faults: dict[int, str] = field(default_factory=dict)
    hang_s: float = 3.0
    # /metrics: None serves none (404); "heron" or "vllm" serves that engine's spec-decode counters, which start
    # at ``spec_initial`` drafts (earlier traffic) and grow by these amounts with each request served
    metrics_prefix: str | None = None
    spec_initial: int = 5
    spec_drafts_per_request: int = 4
    spec_k: int = 3  # draft tokens per draft
    spec_accepted_per_request: int = 6


class FakeOpenAIServer:
    """Streams ``max_tokens`` chunks of one word each: the first after ``ttft_s``, then one every ``itl_s``."""

    def __init__(self, config: FakeConfig | None = None) -> None:
        self.config = config or FakeConfig()
        self.received = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        self.bodies: list[dict] = []
        k, start = self.config.spec_k, self.config.spec_initial
        self.spec = {"num_drafts": start, "num_draft_tokens": start * k, "num_accepted_tokens": start}
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeOpenAIServer:
        self._thread.start()
        self._started.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        if self.config.metrics_prefix:
            app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "owned_by": "fake-engine"}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        n = self.received
        self.received += 1
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        cfg = self.config  # counted on arrival, so the counters are final before any response ends
        self.spec["num_drafts"] += cfg.spec_drafts_per_request
        self.spec["num_draft_tokens"] += cfg.spec_drafts_per_request * cfg.spec_k
        self.spec["num_accepted_tokens"] += cfg.spec_accepted_per_request
        try:
            return await self._respond(request, body, cfg.faults.get(n))
        finally:
            self.in_flight -= 1

    async def _metrics(self, request: web.Request) -> web.Response:
        """The spec-decode counters as vLLM v1 exposes them (``engine`` label; heron has none)."""
        prefix = self.config.metrics_prefix
        labels = 'engine="0",model_name="fake-model"' if prefix == "vllm" else 'model_name="fake-model"'
        running = f"{prefix}:num_requests_running"
        lines = [f"# HELP {running} Requests running", f"# TYPE {running} gauge",
                 f"{running}{{{labels}}} {float(self.in_flight)}"]
        for name, value in self.spec.items():
            metric = f"{prefix}:spec_decode_{name}"
            lines += [f"# HELP {metric}_total {name}", f"# TYPE {metric}_total counter",
                      f"{metric}_total{{{labels}}} {float(value)}", f"{metric}_created{{{labels}}} 1.7e9"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _respond(self, request: web.Request, body: dict, fault: str | None) -> web.StreamResponse:
        cfg = self.config
        if fault == "500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if fault == "hang":
            await asyncio.sleep(cfg.hang_s)
        chat = "messages" in body
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        start = time.perf_counter()
        max_tokens = int(body["max_tokens"])
        for i in range(max_tokens):
            delay = start + cfg.ttft_s + i * cfg.itl_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if fault == "drop" and i == 2:
                request.transport.close()
                return resp
            word = f"w{i % 100} "
            choice = {"index": 0, "delta": {"content": word}} if chat else {"index": 0, "text": word}
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        if cfg.send_usage:
            usage = {"prompt_tokens": 1, "completion_tokens": max_tokens, "total_tokens": max_tokens + 1}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
