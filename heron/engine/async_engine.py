"""The server's engine: a front end in the API process over an ``EngineCore`` in its own process.

Threads of the API process:
- the event loop: HTTP, and one ``RequestStream`` per request;
- the front-end thread (a one-worker executor): owns the tokenizer, the ``InputProcessor`` and the
  ``OutputProcessor``, so every encode, chat template and detokenization runs there, one at a time, and
  off the event loop;
- the core client's reader thread: receives the core's messages and queues them to the front-end thread,
  whose results reach the event loop through ``loop.call_soon_threadsafe``.
Front-end work (adds, aborts, outputs, the news of a death) runs in arrival order on its one thread, so a
request's state exists before its outputs arrive and a death is reported after the outputs before it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from heron.config import EngineConfig
from heron.engine.core_client import CoreClient, rejection_error
from heron.engine.messages import CoreInfo, EngineCoreOutputs, RequestRejection
from heron.engine.output_processor import OutputProcessor
from heron.engine.outputs import EngineStats, RequestOutput
from heron.engine.processor import InputProcessor
from heron.errors import EngineDeadError, EngineOverloadedError, HeronError
from heron.pooling_params import PoolingParams
from heron.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


def load_tokenizer(config: EngineConfig) -> Any:
    """The default tokenizer loader: the model's tokenizer and chat template, without its weights."""
    from heron.model.loader import load_tokenizer_only

    return load_tokenizer_only(config.model, config.tokenizer, config.chat_template)


class RequestStream:
    """The outputs of one request, as an async iterator; ``close()`` aborts the request if unfinished."""

    def __init__(self, request_id: str, engine: AsyncEngine) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.last: RequestOutput | None = None
        self.num_output_tokens = 0  # of all samples, so far
        self._engine = engine

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        while isinstance(item, RequestOutput) and not item.finished and not self.queue.empty():
            later = self.queue.get_nowait()  # outputs are deltas: fold the queued ones into one
            if isinstance(later, BaseException):
                item = later
                break
            item.add(later)
        if isinstance(item, BaseException):
            self.close()
            raise item
        self.finished, self.last = item.finished, item
        self.num_output_tokens += sum(len(c.token_ids) for c in item.outputs)
        return item

    def close(self) -> None:
        """Stop following the request, aborting it in the engine unless it already finished."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    """Tokenizes and detokenizes on its front-end thread, runs the core in a child process, and streams each
    request's outputs (deltas) to asyncio.

    ``core_factory`` builds the core in the child, so it must be importable there (a module-level callable or
    a ``functools.partial`` of one); ``tokenizer_loader`` runs on the front-end thread.
    """

    def __init__(self, config: EngineConfig, core_factory: Callable[[EngineConfig], Any] | None = None,
                 tokenizer_loader: Callable[[EngineConfig], Any] | None = None) -> None:
        self.config = config
        self._load_tokenizer = tokenizer_loader or load_tokenizer
        self._client = CoreClient(config, self._core_ready, self._core_outputs, self._core_dead, core_factory)
        self._frontend = ThreadPoolExecutor(max_workers=1, thread_name_prefix="heron-frontend")
        self._streams: dict[str, asyncio.Queue] = {}
        self._admissions: dict[str, asyncio.Future] = {}
        self._stats = EngineStats()
        self._loaded = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._tokenizer: Any = None
        self._processor: InputProcessor | None = None
        self._output_processor: OutputProcessor | None = None
        self.info: CoreInfo | None = None
        self.load_error: BaseException | None = None
        self.dead_error: EngineDeadError | None = None
        self._refusal: BaseException | None = None

    # ---- lifecycle (event-loop side) ----

    def start(self) -> None:
        """Start the core process (which loads the model) and load the tokenizer meanwhile."""
        self._loop = asyncio.get_running_loop()
        self._frontend.submit(self._load)

    async def wait_loaded(self) -> None:
        """Return once the model and tokenizer are loaded, or either failed to."""
        await self._loaded.wait()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core process (killing it after ``timeout`` seconds) and the front-end thread."""
        if self._closed:
            return
        self._closed = True
        self._frontend.submit(self._client.shutdown, timeout).result()
        self._frontend.shutdown(wait=True, cancel_futures=True)

    @property
    def ready(self) -> bool:
        """True once the model is loaded and the core is alive."""
        return self.info is not None and self.dead_error is None

    @property
    def loading(self) -> bool:
        return not self._loaded.is_set()

    @property
    def core_pid(self) -> int | None:
        """The pid of the engine-core process."""
        return self._client.pid

    def stats(self) -> EngineStats:
        """The core's stats as of its last loop turn."""
        return self._stats

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests (event-loop side) ----

    async def add_request(self, prompt: str | list[int], params: SamplingParams | PoolingParams, request_id: str,
                          priority: int = 0, add_special_tokens: bool = True) -> RequestStream:
        """Queue a request (to generate from, or to pool with ``PoolingParams``); raises the engine's validation
        errors (InvalidRequestError, PromptTooLongError, EngineOverloadedError) before returning the stream of
        its outputs (a pooling request's is one output, carrying its vector).

        A text prompt is tokenized on the front-end thread (``add_special_tokens=False`` for rendered chats,
        whose template already holds them); outputs then carry ``prompt=None``.
        """
        self._check_serving()
        assert request_id not in self._streams, f"duplicate request id {request_id}"
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream.queue
        admitted = self._admissions[request_id] = self._loop.create_future()
        if isinstance(params, SamplingParams):
            params = params.clone(output_kind=RequestOutputKind.DELTA)
        try:
            await self._in_frontend(self._add, request_id, prompt, params, priority, add_special_tokens)
            await admitted
        except BaseException:
            stream.close()
            raise
        finally:
            self._admissions.pop(request_id, None)
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs (deltas); leaving early aborts it."""
        stream = await self.add_request(prompt, params, request_id, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def call(self, fn: Callable[[InputProcessor], Any]) -> Any:
        """Run ``fn(input_processor)`` on the front-end thread (to use the tokenizer) and return its result."""
        self._check_serving()
        return await self._in_frontend(lambda: fn(self._processor))

    async def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """Render chat messages (and tool definitions) to a prompt (on the front-end thread)."""
        return await self.call(lambda p: p.apply_chat_template(messages, tools=tools))

    def abort(self, request_id: str) -> None:
        """Abort a request in the front end and in the core (which frees its blocks at its next turn)."""
        self._streams.pop(request_id, None)
        if self.dead_error is None and not self._closed:
            self._frontend.submit(self._abort, request_id)

    def abort_all(self, error: BaseException) -> int:
        """End every request in flight with ``error`` (raised from its stream, which then aborts it in the core)
        and refuse later ones with it; returns how many were in flight. For a shutdown."""
        self._refusal = error
        for queue in self._streams.values():
            queue.put_nowait(error)
        for request_id in list(self._admissions):
            self._settle(request_id, error)
        return len(self._streams)

    def _check_serving(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self._refusal is not None:
            raise self._refusal
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        if self.info is None:
            raise EngineOverloadedError("the model is still loading; retry shortly")

    async def _in_frontend(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.wrap_future(self._frontend.submit(fn, *args))

    def _deliver(self, outputs: list[RequestOutput], admitted: list[str], rejected: list[RequestRejection]
                 ) -> None:
        for request_id in admitted:
            self._settle(request_id, None)
        for rejection in rejected:
            self._settle(rejection.request_id, rejection_error(rejection))
        for out in outputs:
            stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _settle(self, request_id: str, error: BaseException | None) -> None:
        future = self._admissions.get(request_id)
        if future is None or future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def _loaded_ok(self, info: CoreInfo) -> None:
        if self.load_error is None:
            self.info = info
            self._loaded.set()

    def _load_failed(self, error: BaseException) -> None:
        if self._loaded.is_set():
            return
        logger.error("model failed to load: %s", error, exc_info=not isinstance(error, HeronError))
        self.load_error = error
        self._loaded.set()

    def _die(self, error: BaseException) -> None:
        """Mark the engine dead and fail every request in flight; later requests fail at once."""
        if self.info is None:
            self._load_failed(error)
            return
        if self.dead_error is not None:
            return
        self.dead_error = error if isinstance(error, EngineDeadError) else EngineDeadError(
            f"the engine failed: {type(error).__name__}: {error}")
        for stream in self._streams.values():
            stream.put_nowait(self.dead_error)
        for request_id in list(self._admissions):
            self._settle(request_id, self.dead_error)

    # ---- front-end thread ----

    def _load(self) -> None:
        from heron.model.default_model import fetch_default_model, is_default_model

        try:
            if is_default_model(self.config.model):
                fetch_default_model(self.config.model)  # here, before two processes both download it
            self._client.start()
            self._tokenizer = self._load_tokenizer(self.config)
        except Exception as e:  # noqa: BLE001 - reported by the server, which then exits
            self._loop.call_soon_threadsafe(self._load_failed, e)

    def _add(self, request_id: str, prompt: str | list[int], params: SamplingParams | PoolingParams, priority: int,
             add_special_tokens: bool) -> None:
        """Tokenize and validate (as vLLM's server does, refusing a max_tokens the context cannot hold), then
        send to the core."""
        request = self._processor.process(request_id, prompt, params, priority, None, add_special_tokens,
                                          max_tokens_must_fit=True)
        self._client.add_request(request)
        self._output_processor.add(request_id, prompt if isinstance(prompt, str) else None,
                                   request.prompt_token_ids, params, request.arrival_time)

    def _abort(self, request_id: str) -> None:
        self._output_processor.abort(request_id)
        try:
            self._client.abort_requests([request_id])
        except EngineDeadError:
            pass

    def _process(self, core_outputs: EngineCoreOutputs) -> None:
        """Detokenize one core turn's deltas and hand the results to the event loop."""
        try:
            for rejection in core_outputs.rejected:
                self._output_processor.abort(rejection.request_id)
            outputs, stopped = self._output_processor.process(core_outputs.outputs)
            if stopped:
                self._client.stop_samples(stopped)
        except EngineDeadError:
            return  # the reader reports the death
        except Exception as e:  # noqa: BLE001 - a front-end bug must not pass silently
            logger.exception("processing the core's outputs failed")
            self._loop.call_soon_threadsafe(self._die, e)
            return
        if outputs or core_outputs.admitted or core_outputs.rejected:
            self._loop.call_soon_threadsafe(self._deliver, outputs, core_outputs.admitted, core_outputs.rejected)

    def _ready_in_frontend(self, info: CoreInfo) -> None:
        if self._tokenizer is None:
            return  # the tokenizer failed to load: already reported
        self._processor = InputProcessor(self._tokenizer, info)
        self._output_processor = OutputProcessor(self._tokenizer)
        self._loop.call_soon_threadsafe(self._loaded_ok, info)

    # ---- core client callbacks (reader thread) ----

    def _core_ready(self, info: CoreInfo) -> None:
        self._frontend.submit(self._ready_in_frontend, info)

    def _core_outputs(self, outputs: EngineCoreOutputs) -> None:
        if outputs.stats is not None:
            self._stats = outputs.stats
        self._frontend.submit(self._process, outputs)

    def _core_dead(self, error: BaseException) -> None:
        self._frontend.submit(self._loop.call_soon_threadsafe, self._die, error)
