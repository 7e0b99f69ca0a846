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


class FakeOpenAIServer:
    """Streams ``max_tokens`` chunks of one word each: the first after ``ttft_s``, then one every ``itl_s``."""

    def __init__(self, config: FakeConfig | None = None) -> None:
        self.config = config or FakeConfig()
        self.received = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        self.bodies: list[dict] = []
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
        try:
            return await self._respond(request, body, self.config.faults.get(n))
        finally:
            self.in_flight -= 1

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
