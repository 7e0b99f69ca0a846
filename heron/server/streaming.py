"""Plumbing shared by the generation endpoints: disconnect handling, server-sent events, stream merging."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from heron.engine.async_engine import RequestStream
from heron.engine.outputs import RequestOutput

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it (and raising ClientDisconnected) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


async def wait_for_request(request: Request, work: Awaitable[T]) -> T:
    """``cancel_on_disconnect`` for a request whose body has already been read."""
    return await cancel_on_disconnect(request.receive, work)


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response whose generator is closed (aborting its requests) once the client leaves."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with contextlib.aclosing(self.body_iterator):
                with contextlib.suppress(ClientDisconnected, OSError):
                    await cancel_on_disconnect(receive, self.stream_response(send))
        finally:
            self.on_close()


# JSON leaves these unescaped, but clients that split lines as str.splitlines does (httpx's ``aiter_lines``) end
# an event's line at them, mid-string; as \u escapes they decode to the same text
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event carrying ``payload`` (a dict, or a pre-serialised JSON string), on one line for
    every client."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data.translate(_LINE_BREAKS)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield ``(stream index, output)`` from several request streams as outputs arrive, until all finish."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                merged.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            merged.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await merged.get()
            if isinstance(item, Exception):
                raise item
            yield i, item
            remaining -= item.finished
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
