"""Starts tensor-parallel ranks 1..N-1, joins this process (the engine core, rank 0) to them, mirrors the runner's
calls to them, and watches them.

``mp`` (the default): the ranks are spawned processes of this machine, joined over loopback TCP. ``ray``: they
are Ray actors in a placement group, so they may live on other machines of a Ray cluster
(``heron/distributed/ray_executor.py``). Either way a rank that dies is seen at once: mid-step, the collective
rank 0 waits in fails (its peer's sockets closed) and ``explain`` names the dead rank; between steps, a watcher
thread wakes the engine core's loop (``wait_handles``), whose ``check_health`` then raises. The engine core
treats that as any failed step: in-flight requests get an error, the server reports unhealthy and exits.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import pickle
import secrets
import signal
import socket
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from heron.config import EngineConfig
from heron.distributed import shm_all_reduce
from heron.distributed.parallel_state import (
    destroy_tensor_parallel,
    get_tp_group,
    init_tensor_parallel,
    send_command,
)
from heron.distributed.shm_all_reduce import ShmAllReduce
from heron.errors import ConfigError, HeronError, WorkerDiedError
from heron.worker.worker import SHUTDOWN, rank_device, run_worker

logger = logging.getLogger(__name__)

DEATH_GRACE_SECONDS = 2.0  # how long a failed collective waits for its dead peer to be noticed
STOP_SECONDS = 5.0  # how long shutdown waits for a rank to leave before killing it


class Executor(ABC):
    """The ranks other than this one, as rank 0 sees them: start, mirror calls (``ModelRunner.Peers``), watch,
    stop."""

    def __init__(self, config: EngineConfig, threads: int) -> None:
        self.config = config
        self.size = config.tensor_parallel_size
        self.threads = threads
        self.dead: str | None = None  # what happened to the rank that died
        self._serving = False  # every rank has loaded and waits for calls (so a shutdown command reaches them)
        self._closed = False
        self._wake_read, self._wake_write = os.pipe()
        self.shm_path: str | None = None  # the shared-memory all-reduce segment, while it has a name

    def start(self) -> None:
        """Start ranks 1..N-1 and join them as rank 0; returns once every rank has joined."""
        device = rank_device(self.config, 0)
        if device.type == "cuda":
            self._check_gpus()
            torch.cuda.set_device(device)
        init_method = self._start_workers()
        atexit.register(self.shutdown)  # an LLM left open still stops its ranks cleanly at exit
        threading.Thread(target=self._watch, name="heron-rank-watcher", daemon=True).start()
        failure: list[BaseException] = []

        def join() -> None:
            try:
                init_tensor_parallel(0, self.size, init_method, "nccl" if device.type == "cuda" else "gloo",
                                     self.shm_path)
            except BaseException as e:  # noqa: BLE001 - re-raised in the starting thread
                failure.append(e)

        joining = threading.Thread(target=join, daemon=True)
        joining.start()
        while joining.is_alive():  # a rank that dies before joining would leave rank 0 waiting for ever
            joining.join(0.2)
            self.check_health()
        if failure:
            raise failure[0]
        logger.info("tensor parallelism: %d ranks (%s executor), %d CPU threads each", self.size,
                    self.name, self.threads)

    def wait_until_loaded(self) -> None:
        """Return once every rank has loaded its shard (rank 0 calls this after loading its own)."""
        try:
            dist.barrier()
        except Exception as e:
            self.explain(e)
            raise
        self._serving = True
        self._unlink_shm()  # every rank has mapped it: the name can go, the memory stays until the ranks exit

    def _unlink_shm(self) -> None:
        if self.shm_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.shm_path)
            self.shm_path = None

    # ---- ModelRunner.Peers -----------------------------------------------------------------------------------
    def send(self, method: str, args: tuple, kwargs: dict) -> None:
        self.check_health()
        # tensors travel through the CPU: each rank moves them to its own device
        self._send_command((method, tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args), kwargs))

    def explain(self, error: BaseException) -> None:
        """Raise ``WorkerDiedError`` (from ``error``) if a rank died; give the watcher a moment to notice."""
        deadline = time.monotonic() + DEATH_GRACE_SECONDS
        while self.dead is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.dead is not None:
            raise WorkerDiedError(self.dead) from error

    # ---- health -----------------------------------------------------------------------------------------------
    def check_health(self) -> None:
        """Raise ``WorkerDiedError`` if a rank has died."""
        if self.dead is not None:
            raise WorkerDiedError(self.dead)

    @property
    def wait_handles(self) -> list[int]:
        """Readable once a rank has died: an idle engine loop waits on it with its commands."""
        return [self._wake_read]

    def _check_gpus(self) -> None:
        """Refuse a size the GPUs cannot take (each rank uses ``cuda:<rank>`` of its machine)."""
        if torch.cuda.device_count() < self.size:
            raise ConfigError(f"--tensor-parallel-size {self.size} needs {self.size} GPUs; this machine has "
                              f"{torch.cuda.device_count()}")

    def _watch(self) -> None:
        try:
            why = self._wait_for_death()
        except Exception as e:  # noqa: BLE001 - a watcher that cannot watch must not leave the engine blind
            why = f"tensor-parallel ranks cannot be watched any more ({type(e).__name__}: {e})"
        if self._closed:
            return
        self.dead = why
        shm = get_tp_group().shm
        if shm is not None:
            shm.abort()  # a rank spinning on the dead one's flag gives up
        logger.error("%s; the engine stops", why)
        os.write(self._wake_write, b"!")

    def shutdown(self) -> None:
        """Tell the ranks to leave (killing those that do not within a few seconds) and leave the group."""
        if self._closed:
            return
        self._closed = True
        if self._serving and self.dead is None:
            try:
                self._send_command(SHUTDOWN)
            except Exception:  # noqa: BLE001 - a rank is gone already: it is stopped below either way
                logger.debug("could not send the shutdown command", exc_info=True)
        self._stop_workers()
        self._unlink_shm()
        destroy_tensor_parallel()

    # ---- what an executor kind provides ------------------------------------------------------------------------
    name = "?"

    def _send_command(self, command: Any) -> None:
        """Deliver a command to every other rank: by default a broadcast over the control process group."""
        send_command(command)

    @abstractmethod
    def _start_workers(self) -> str:
        """Start ranks 1..N-1 (each running ``run_worker``); returns the init method they join at."""

    @abstractmethod
    def _wait_for_death(self) -> str:
        """Block until a rank ends; returns what happened to it (called once, in the watcher thread)."""

    @abstractmethod
    def _stop_workers(self) -> None:
        """Wait a few seconds for the ranks to leave, then kill those still there."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _worker_main(config: EngineConfig, rank: int, size: int, init_method: str, threads: int, log_level: int,
                 commands: Connection, errors: Connection, shm_path: str | None) -> None:
    """A spawned rank: ``run_worker`` on the commands of its pipe, its failure sent to rank 0 before the
    process exits with code 1."""
    try:
        run_worker(config, rank, size, init_method, threads, log_level, lambda: pickle.loads(commands.recv_bytes()),
                   shm_path)
    except EOFError:
        logging.getLogger(__name__).warning("rank 0 is gone; tensor-parallel rank %d exits", rank)
        sys.exit(1)
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, then this process exits
        if not isinstance(e, HeronError):  # a user's error (a bad size, a bad file) is said once, by rank 0
            logging.getLogger(__name__).exception("tensor-parallel rank %d failed", rank)
        errors.send(f"{type(e).__name__}: {e}")
        sys.exit(1)


@contextmanager
def _children_allowed() -> Iterator[None]:
    """Let a daemonic process (the server's engine core, which must die with the API process) start daemonic
    ranks, which multiprocessing refuses by default: the ranks die with it all the same, since a rank whose
    peer is gone fails its next collective and exits."""
    process = multiprocessing.current_process()
    daemon = process._config.get("daemon")
    process._config["daemon"] = False
    try:
        yield
    finally:
        process._config["daemon"] = daemon


class MultiprocExecutor(Executor):
    """Ranks 1..N-1 as spawned processes of this machine (``--distributed-executor-backend mp``). Commands go
    through one pipe per rank: a pickled step costs tens of microseconds there, against a millisecond or more
    for the two gloo broadcasts of ``broadcast_object_list``."""

    name = "mp"

    def __init__(self, config: EngineConfig, threads: int) -> None:
        super().__init__(config, threads)
        if (shm_all_reduce.supported() and rank_device(config, 0).type == "cpu"
                and os.environ.get("HERON_SHM_ALL_REDUCE", "1") != "0"):
            self.shm_path = f"/dev/shm/heron-tp-{os.getpid()}-{secrets.token_hex(4)}"

    def _start_workers(self) -> str:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        if self.shm_path:
            ShmAllReduce.create(self.shm_path, self.size)
        ctx = multiprocessing.get_context("spawn")
        self.processes, self.errors, self.commands = {}, {}, {}
        for rank in range(1, self.size):
            commands_read, commands_write = ctx.Pipe(duplex=False)
            errors_read, errors_write = ctx.Pipe(duplex=False)
            process = ctx.Process(target=_worker_main, name=f"heron-rank-{rank}", daemon=True,
                                  args=(self.config, rank, self.size, init_method, self.threads,
                                        logging.getLogger().getEffectiveLevel(), commands_read, errors_write,
                                        self.shm_path))
            with _children_allowed():
                process.start()
            commands_read.close()
            errors_write.close()
            self.processes[rank], self.errors[rank], self.commands[rank] = process, errors_read, commands_write
        return init_method

    def _send_command(self, command: Any) -> None:
        payload = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        for pipe in self.commands.values():
            pipe.send_bytes(payload)

    def _wait_for_death(self) -> str:
        sentinels = {p.sentinel: rank for rank, p in self.processes.items()}
        rank = sentinels[wait(list(sentinels))[0]]
        process = self.processes[rank]
        process.join()
        code = process.exitcode
        how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}")
        try:
            reason = f": {self.errors[rank].recv()}"
        except EOFError:  # it died without a word (a signal, or before it could say)
            reason = ""
        if code == 1 and not reason:  # Python failed before heron's code ran in the rank: mostly this
            reason = (" before heron's code ran in it (its traceback is above): under multiprocessing's spawn a "
                      "script that starts heron must keep its top level under `if __name__ == \"__main__\":`")
        return f"tensor-parallel rank {rank} (pid {process.pid}) {how}{reason}"

    def _stop_workers(self) -> None:
        deadline = time.monotonic() + STOP_SECONDS
        for process in self.processes.values():
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()


def make_executor(config: EngineConfig, threads: int) -> Executor:
    """The executor ``--distributed-executor-backend`` names (``mp`` unless ``ray``)."""
    if config.distributed_executor_backend == "ray":
        from heron.distributed.ray_executor import RayExecutor

        return RayExecutor(config, threads)
    return MultiprocExecutor(config, threads)
