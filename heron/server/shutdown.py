"""Graceful shutdown: the first SIGTERM (or SIGINT) drains the server before uvicorn stops it.

While draining, new generation requests and ``/health`` answer 503, and the requests in flight may finish for up
to ``--shutdown-timeout`` seconds. Those still running then end with an error (a stream gets an error event and
``[DONE]``), and only then does uvicorn close the connections (giving responses ``FLUSH_TIMEOUT`` seconds to be
written) and stop the engine; the process exits 0. A second signal ends the drain at once, a third stops
without waiting for responses.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

import uvicorn

from heron.engine.async_engine import AsyncEngine
from heron.server.http_errors import APIError

logger = logging.getLogger("heron.server")

FLUSH_TIMEOUT = 1.0


class Drain:
    """The drain's state: the routes ask ``check_admitting()``, the server calls ``begin()`` then ``poll()``."""

    def __init__(self, engine: AsyncEngine, timeout: float) -> None:
        self.engine, self.timeout = engine, timeout
        self.deadline: float | None = None

    @property
    def draining(self) -> bool:
        """True once the drain has begun."""
        return self.deadline is not None

    def check_admitting(self) -> None:
        """Raise a 503 once the drain has begun."""
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another instance", code="shutting_down")

    def begin(self, reason: str) -> None:
        """Stop admitting requests; those in flight have ``timeout`` seconds from now."""
        self.deadline = time.monotonic() + self.timeout
        logger.info("%s received: refusing new requests; %d in flight may run for up to %gs", reason,
                    self.engine.num_in_flight, self.timeout)

    def poll(self, hurry: bool = False) -> bool:
        """True once nothing is in flight, the time is up or ``hurry``; the requests still running are then
        ended."""
        if self.engine.num_in_flight and time.monotonic() < self.deadline and not hurry:
            return False
        ended = self.engine.abort_all(APIError(503, "the server shut down before this request finished",
                                               code="shutting_down"))
        if ended:
            logger.warning("shutdown timeout: ended %d request(s) still running with an error", ended)
        return True


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with a ``Drain`` between the first SIGTERM/SIGINT and uvicorn's own shutdown."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self.signal: signal.Signals | None = None
        self.hurry = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # In a signal handler: only set flags; on_tick acts on them from the event loop.
        if self.signal is None:
            self.signal = signal.Signals(sig)
        elif not self.should_exit:
            self.hurry = True
        else:
            self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick (every 0.1 s), which also begins and polls the drain."""
        if self.signal is not None and not self.should_exit:
            if not self.drain.draining:
                self.drain.begin(self.signal.name)
            self.should_exit = self.drain.poll(self.hurry)
        return await super().on_tick(counter)
