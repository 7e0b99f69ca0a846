"""The engine-core process: an ``EngineCore`` serving commands from the API process over a pipe.

Wire format: msgspec msgpack, one message per ``send_bytes``. The API process sends ``CoreCommand``s (add,
abort, stop samples, shutdown); the core answers with ``CoreEvent``s: ``CoreReady`` once loaded (or
``CoreFailed``), then one ``CoreStep`` per loop turn, carrying the step's deltas, the adds it admitted or
rejected, and a stats snapshot. A step that raises is logged here with its traceback, reported as
``CoreFailed`` and ends the process with exit code 1; a request the core refuses is only rejected. A request
with a grammar to compile is admitted or rejected in the turn after its compile ends (off the step loop).

Loop: drain the commands (while idle, first blocking until a command comes or a grammar compile ends; polling
while busy), admit the requests whose grammar compiled, step if there is work, report.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import msgspec

from heron.config import EngineConfig
from heron.cpu import set_engine_threads
from heron.engine.messages import CoreInfo, EngineCoreOutputs, EngineCoreRequest, RequestRejection
from heron.errors import HeronError

logger = logging.getLogger(__name__)


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class StopSamples(msgspec.Struct, tag="stop", array_like=True):
    samples: list[tuple[str, int]]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class CoreReady(msgspec.Struct, tag="ready", array_like=True):
    info: CoreInfo


class CoreFailed(msgspec.Struct, tag="failed", array_like=True):
    """The core failed to load, or a step raised: the error's class name and message."""

    kind: str
    message: str


class CoreStep(msgspec.Struct, tag="step", array_like=True):
    outputs: EngineCoreOutputs


CoreCommand = AddRequest | AbortRequests | StopSamples | Shutdown
CoreEvent = CoreReady | CoreFailed | CoreStep


def build_engine_core(config: EngineConfig) -> Any:
    """The default core factory: the real ``EngineCore`` (imported here, so only the core process loads torch
    models)."""
    from heron.engine.core import EngineCore

    return EngineCore(config)


def run_core_process(config: EngineConfig, core_factory: Callable[[EngineConfig], Any], commands: Connection,
                     events: Connection, log_level: int) -> None:
    """Main of the core process: build the core, say so, then serve commands until shutdown or the API process
    is gone."""
    # Ctrl-C reaches the whole process group; the API process decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    encoder = msgspec.msgpack.Encoder()
    try:
        set_engine_threads(config.cpu_threads, serving=True, ranks=config.tensor_parallel_size)
        core = core_factory(config)
    except Exception as e:  # noqa: BLE001 - reported to the API process, which exits with the message
        if not isinstance(e, HeronError):
            logger.exception("the engine core failed to load")
        events.send_bytes(encoder.encode(CoreFailed(type(e).__name__, str(e))))
        sys.exit(1)
    events.send_bytes(encoder.encode(CoreReady(core.info)))
    try:
        ok = CoreLoop(core, commands, events).run()
    except BrokenPipeError:
        logger.warning("the API process is gone; the engine core exits")
        ok = True
    finally:
        core.shutdown()
    logging.shutdown()
    # Everything the API process needs has been sent: skip interpreter teardown (torch's takes ~1 s, which a
    # drain-then-exit on SIGTERM would otherwise spend), and a grammar compile still running with it.
    os._exit(0 if ok else 1)


class CoreLoop:
    """Drains commands, steps the core and reports, until a shutdown command or the end of the pipe."""

    def __init__(self, core: Any, commands: Connection, events: Connection) -> None:
        self.core = core
        self.commands, self.events = commands, events
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreCommand)

    def run(self) -> bool:
        """Serve until told to stop (True) or until a step fails (False, after reporting it)."""
        while True:
            report = EngineCoreOutputs()
            if not self._drain(report, block=not self.core.has_work_to_step()):
                return True
            admitted, rejected = self.core.admit_compiled()
            report.admitted.extend(admitted)
            report.rejected.extend(rejected)
            try:
                self.core.check_health()  # a dead tensor-parallel rank fails the core even while it idles
                if self.core.has_work_to_step():
                    report.outputs = self.core.step()
            except Exception as e:  # noqa: BLE001 - fatal: reported, then the process exits
                logger.exception("the engine core failed; the core process exits")
                self._send(CoreStep(report))  # the adds it admitted first, so they fail as streams
                self._send(CoreFailed(type(e).__name__, str(e)))
                return False
            report.stats = self.core.stats()
            self._send(CoreStep(report))

    def _drain(self, report: EngineCoreOutputs, block: bool) -> bool:
        """Handle the queued commands (if ``block``, first waiting for one or for a grammar compile to end);
        False once told to stop."""
        if block:
            wait([self.commands, *self.core.wait_handles()])
        while self.commands.poll():
            try:
                command = self._decoder.decode(self.commands.recv_bytes())
            except EOFError:
                logger.warning("the API process is gone; the engine core exits")
                return False
            if isinstance(command, Shutdown):
                return False
            self._handle(command, report)
        return True

    def _handle(self, command: AddRequest | AbortRequests | StopSamples, report: EngineCoreOutputs) -> None:
        if isinstance(command, AbortRequests):
            self.core.abort_requests(command.request_ids)
        elif isinstance(command, StopSamples):
            self.core.stop_samples(command.samples)
        else:
            request_id = command.request.request_id
            try:
                admitted = self.core.add_request(command.request)
            except Exception as e:  # noqa: BLE001 - the front end raises it to the client
                if not isinstance(e, HeronError):
                    logger.exception("adding request %s failed", request_id)
                report.rejected.append(RequestRejection(request_id, type(e).__name__, str(e),
                                                        getattr(e, "param", None)))
                return
            if admitted:  # else it waits for its grammar: admit_compiled reports it
                report.admitted.append(request_id)

    def _send(self, event: CoreStep | CoreFailed) -> None:
        self.events.send_bytes(self._encoder.encode(event))
