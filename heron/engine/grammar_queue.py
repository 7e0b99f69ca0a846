"""Requests waiting for their grammar to compile (vLLM's WAITING_FOR_FSM), held outside the scheduler.

The core hands a request's constraint to the ``StructuredOutputCompiler`` (which compiles off the step loop)
and parks the request here. The compile thread queues each finished compile and makes ``handle`` readable, so
that a core loop blocked on its commands wakes up; the core then admits each ready request into the scheduler,
or rejects it with the compile's error. Only the core's thread calls these methods.
"""

from __future__ import annotations

import functools
import socket
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from heron.engine.request import Request
from heron.sampling_params import GuidedDecodingParams


class GrammarQueue:
    """Parked requests and the grammar compiler behind them (started by the first grammar)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._compiler_args = (tokenizer, vocab_size, sorted(eos_token_ids))
        self._compiler: Any = None
        self._waiting: dict[str, Request] = {}
        self._ready: deque[tuple[Request, Future]] = deque()  # appended by the compile thread
        self._wake: tuple[socket.socket, socket.socket] | None = None

    def compile(self, guided: GuidedDecodingParams) -> Future:
        """A future of the compiled grammar (done at once if cached); see ``StructuredOutputCompiler.submit``."""
        if self._compiler is None:
            from heron.sampling.structured import StructuredOutputCompiler  # xgrammar loads only when used

            self._compiler = StructuredOutputCompiler(*self._compiler_args)
            self._wake = socket.socketpair()
            for end in self._wake:
                end.setblocking(False)
        return self._compiler.submit(guided)

    def park(self, req: Request, compiled: Future) -> None:
        """Hold ``req`` until ``compiled`` is done."""
        self._waiting[req.request_id] = req
        compiled.add_done_callback(functools.partial(self._done, req))

    def remove(self, request_id: str) -> bool:
        """Forget a parked request (aborted); False if it is not here."""
        return self._waiting.pop(request_id, None) is not None

    def take_ready(self) -> list[tuple[Request, Future]]:
        """The parked requests whose compile ended since the last call, with its future (a grammar or an error)."""
        if self._wake is None:
            return []
        try:
            while self._wake[0].recv(4096):
                pass
        except BlockingIOError:
            pass
        ready = []
        while self._ready:
            req, compiled = self._ready.popleft()
            if self._waiting.get(req.request_id) is req:
                del self._waiting[req.request_id]
                ready.append((req, compiled))
        return ready

    @property
    def handles(self) -> list[socket.socket]:
        """What becomes readable when a compile ends (for a loop that blocks on its commands)."""
        return [self._wake[0]] if self._wake is not None else []

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def _done(self, req: Request, compiled: Future) -> None:
        self._ready.append((req, compiled))
        try:
            self._wake[1].send(b"\0")
        except BlockingIOError:
            pass  # the socket is full of wake-ups already
