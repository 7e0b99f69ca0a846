"""Async front of the synchronous Engine: one engine thread runs the step loop, each request gets its own stream.

The ``Engine`` is built and driven only by the engine thread; the event loop talks to it through a thread-safe
command queue and receives outputs through ``loop.call_soon_threadsafe``, one callback per engine step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from heron.config import EngineConfig
from heron.engine.outputs import EngineStats, RequestOutput
from heron.errors import EngineDeadError, EngineOverloadedError, HeronError, PromptTooLongError
from heron.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    add_special_tokens: bool
    done: Future = field(default_factory=Future)


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    done: Future = field(default_factory=Future)


@dataclass
class _Abort:
    request_id: str


_STOP = object()


@dataclass
class ModelInfo:
    """Facts about the loaded model, safe to read from any thread (the tokenizer only for decoding)."""

    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any


def _default_factory(config: EngineConfig):
    from heron.engine.engine import Engine

    return Engine(config)


class RequestStream:
    """The outputs of one request, as an async iterator; ``close()`` aborts the request if unfinished."""

    def __init__(self, request_id: str, engine: AsyncEngine) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.last: RequestOutput | None = None
        self._engine = engine

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        while isinstance(item, RequestOutput) and not item.finished and not self.queue.empty():
            item = self.queue.get_nowait()  # outputs are cumulative: skip to the newest
        if isinstance(item, BaseException):
            self.close()
            raise item
        self.finished, self.last = item.finished, item
        return item

    def close(self) -> None:
        """Stop following the request, aborting it in the engine unless it already finished."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    """Runs ``Engine.step()`` in a background thread and streams each request's outputs to asyncio."""

    def __init__(self, config: EngineConfig, engine_factory: Callable[[EngineConfig], Any] | None = None) -> None:
        self.config = config
        self._factory = engine_factory or _default_factory
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._stats = EngineStats()
        self._loaded = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine: Any = None
        self.info: ModelInfo | None = None
        self.load_error: BaseException | None = None
        self.dead_error: EngineDeadError | None = None

    # ---- lifecycle (event-loop side) ----

    def start(self) -> None:
        """Start the engine thread, which loads the model and then runs the step loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="heron-engine", daemon=True)
        self._thread.start()

    async def wait_loaded(self) -> None:
        """Return once the model is loaded or failed to load."""
        await asyncio.to_thread(self._loaded.wait)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and stop the engine thread."""
        for request_id in list(self._streams):
            self._commands.put(_Abort(request_id))
        self._commands.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def ready(self) -> bool:
        """True once the model is loaded and the loop is healthy."""
        return self.info is not None and self.dead_error is None

    @property
    def loading(self) -> bool:
        return not self._loaded.is_set()

    def stats(self) -> EngineStats:
        """The engine's stats as of its last step (or command)."""
        return self._stats

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests (event-loop side) ----

    async def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                          priority: int = 0, add_special_tokens: bool = True) -> RequestStream:
        """Queue a request; raises the engine's validation errors (InvalidRequestError, PromptTooLongError,
        EngineOverloadedError) before returning the stream of its outputs.

        A text prompt is tokenized on the engine thread (``add_special_tokens=False`` for rendered chats,
        whose template already holds them); outputs then carry ``prompt=None``.
        """
        self._check_serving()
        assert request_id not in self._streams, f"duplicate request id {request_id}"
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream.queue
        command = _Add(request_id, prompt, params, priority, add_special_tokens)
        self._commands.put(command)
        try:
            await asyncio.wrap_future(command.done)
        except BaseException:
            stream.close()
            raise
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its cumulative outputs; leaving early aborts it."""
        stream = await self.add_request(prompt, params, request_id, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread (e.g. to use the tokenizer) and return its result."""
        self._check_serving()
        command = _Call(fn)
        self._commands.put(command)
        return await asyncio.wrap_future(command.done)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """Render chat messages to a prompt (a read-only use of the engine, safe from the event loop)."""
        self._check_serving()
        return self._engine.apply_chat_template(messages)

    def abort(self, request_id: str) -> None:
        """Abort a request in the engine (its blocks are freed at the engine's next turn)."""
        self._streams.pop(request_id, None)
        self._commands.put(_Abort(request_id))

    def _check_serving(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self.info is None:
            raise EngineOverloadedError("the model is still loading; retry shortly")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(error)

    # ---- engine thread ----

    def _run(self) -> None:
        try:
            self._engine = self._factory(self.config)
            self.info = ModelInfo(self._engine.model_name, self._engine.max_model_len,
                                  self._engine.vocab_size, self._engine.tokenizer)
            self._stats = self._engine.stats()
        except BaseException as e:  # noqa: BLE001 - reported by the server, which then exits
            logger.error("model failed to load: %s", e, exc_info=not isinstance(e, HeronError))
            self.load_error = e
            return
        finally:
            self._loaded.set()
        while True:
            try:
                if not self._serve_commands(block=not self._busy()):
                    return
                if self._busy():
                    self._step()
            except Exception as e:  # noqa: BLE001 - any engine failure kills the loop, never hangs it
                self._die(e)

    def _busy(self) -> bool:
        return self.dead_error is None and self._engine.has_unfinished_requests()

    def _serve_commands(self, block: bool) -> bool:
        """Handle queued commands (waiting for one if ``block``); False once asked to stop."""
        handled = False
        while True:
            try:
                command = self._commands.get(block=block and not handled)
            except queue.Empty:
                break
            if command is _STOP:
                return False
            self._handle(command)
            handled = True
        if handled and self.dead_error is None:
            self._stats = self._engine.stats()
        return True

    def _handle(self, command: _Add | _Call | _Abort) -> None:
        if isinstance(command, _Abort):
            if self.dead_error is None:
                self._engine.abort_request(command.request_id)
            return
        if not command.done.set_running_or_notify_cancel():
            return
        try:
            if self.dead_error is not None:
                raise self.dead_error
            if isinstance(command, _Call):
                command.done.set_result(command.fn(self._engine))
                return
            self._admit(command)
            command.done.set_result(None)
        except Exception as e:  # noqa: BLE001 - handed to the waiting request
            command.done.set_exception(e)

    def _admit(self, command: _Add) -> None:
        """Queue a request; as vLLM's server does, refuse one whose max_tokens cannot fit the context."""
        params, limit = command.params, self.info.max_model_len
        token_ids = self._engine.encode(command.prompt, add_special_tokens=command.add_special_tokens)
        n = len(token_ids)
        if params.max_tokens is not None and n < limit < n + params.max_tokens:
            raise PromptTooLongError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} in the completion). "
                "Reduce the prompt or max_tokens.", param="max_tokens")
        self._engine.add_request(command.request_id, token_ids, params, priority=command.priority)

    def _step(self) -> None:
        outputs = self._engine.step()
        self._stats = self._engine.stats()
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _die(self, error: Exception) -> None:
        """Mark the engine dead and fail every request in flight; later requests fail at once."""
        logger.error("the engine failed; failing all in-flight requests", exc_info=error)
        self.dead_error = EngineDeadError(f"the engine stopped after an internal error: {type(error).__name__}")
        self._loop.call_soon_threadsafe(self._fail_all, self.dead_error)
