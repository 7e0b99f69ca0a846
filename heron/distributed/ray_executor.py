"""Ranks 1..N-1 as Ray actors (``--distributed-executor-backend ray``), so they may run on other machines.

Rank 0 stays the engine core's own process, which becomes a Ray driver: it joins the cluster ``RAY_ADDRESS``
names (or the one running on this machine; with none, it starts one here), reserves one placement-group bundle
per rank, and starts one actor in each. An actor's single call, ``run``, is the rank's whole life
(``run_worker``): its ObjectRef completes only when the rank's loop ends, so the watcher waits on those refs.
The ranks join rank 0 over TCP at this node's IP: every node must reach the others directly.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

import torch

from heron.config import EngineConfig
from heron.distributed.executor import STOP_SECONDS, Executor, free_port
from heron.errors import ConfigError
from heron.worker.worker import run_worker

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT = 60.0  # seconds the cluster has to grant every rank's bundle
STRATEGY_ENV = "HERON_RAY_PLACEMENT_STRATEGY"
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class _Rank:
    """The body of a rank's Ray actor (made remote when the executor starts: Ray is imported lazily)."""

    def where(self) -> tuple[str, str, int]:
        """This actor's id, node IP and process id."""
        import ray

        return ray.get_runtime_context().get_actor_id(), ray.util.get_node_ip_address(), os.getpid()

    def run(self, config: EngineConfig, rank: int, size: int, init_method: str, threads: int,
            log_level: int) -> None:
        run_worker(config, rank, size, init_method, threads, log_level)


class RayExecutor(Executor):
    """Ranks 1..N-1 as Ray actors in a placement group, possibly on other nodes of a Ray cluster."""

    name = "ray"

    def __init__(self, config: EngineConfig, threads: int) -> None:
        super().__init__(config, threads)
        self.actors: list[Any] = []
        self.places: list[Any] = []  # refs of each actor's ``where()``
        self.loops: list[Any] = []  # refs of each actor's ``run()``: done when its rank's loop ends
        self.group: Any = None  # the placement group
        self._owns_ray = False  # Ray was started by this executor (not joined), so it stops it too
        self._watched = threading.Event()  # the watcher made its last Ray call

    def _start_workers(self) -> str:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._connect()
        gpus = 1 if torch.cuda.is_available() else 0
        self.group = self._place(gpus)
        ip = ray.util.get_node_ip_address()
        init_method = f"tcp://{ip}:{free_port(ip)}"
        env = {"OMP_NUM_THREADS": str(self.threads)}
        if gpus:  # a rank picks its GPU by its rank (``rank_device``), so it must see them all
            env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        actor = ray.remote(_Rank)
        log_level = logging.getLogger().getEffectiveLevel()
        for rank in range(1, self.size):
            strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank - 1)
            handle = actor.options(num_cpus=self.threads, num_gpus=gpus, max_restarts=0,
                                   scheduling_strategy=strategy, runtime_env={"env_vars": env}).remote()
            self.actors.append(handle)
            self.places.append(handle.where.remote())
            self.loops.append(handle.run.remote(self.config, rank, self.size, init_method, self.threads,
                                                log_level))
        return init_method

    def _connect(self) -> None:
        """Join the Ray cluster ``RAY_ADDRESS`` names or the one running on this machine; with neither, start
        one here (as vLLM does)."""
        import ray

        if ray.is_initialized():
            return
        address = os.environ.get("RAY_ADDRESS")
        if address:
            _check_reachable(address)  # ray.init retries an unreachable address for minutes, silently
        try:
            ray.init(address="auto", log_to_driver=True, ignore_reinit_error=True)
        except ConnectionError:
            if address:
                raise
            logger.info("no Ray cluster is running: starting one on this machine")
            ray.init(address="local", log_to_driver=True, ignore_reinit_error=True)
            self._owns_ray = True

    def _place(self, gpus: int) -> Any:
        """Reserve one bundle per rank 1..N-1; raises ``ConfigError`` if the cluster cannot grant them."""
        import ray
        from ray.util.placement_group import placement_group

        strategy = os.environ.get(STRATEGY_ENV, "PACK").upper()
        if strategy not in STRATEGIES:
            raise ConfigError(f"{STRATEGY_ENV}={strategy} is not a placement strategy: use one of "
                              f"{', '.join(STRATEGIES)}")
        bundle = {"CPU": self.threads, **({"GPU": gpus} if gpus else {})}
        group = placement_group([bundle] * (self.size - 1), strategy=strategy, name=f"heron-tp-{os.getpid()}")
        if group.wait(PLACEMENT_TIMEOUT):
            return group
        ray.util.remove_placement_group(group)
        total, free = ray.cluster_resources(), ray.available_resources()
        have = ", ".join(f"{total.get(key, 0):g} {key}s ({free.get(key, 0):g} free)" for key in bundle)
        raise ConfigError(f"the Ray cluster cannot place {self.size - 1} tensor-parallel rank(s) of {bundle} "
                          f"each ({strategy}) within {PLACEMENT_TIMEOUT:g} s: it has {have}. Add nodes "
                          "(ray start --address ...), lower --cpu-threads or --tensor-parallel-size, or set "
                          f"{STRATEGY_ENV}")

    def _wait_for_death(self) -> str:
        import ray

        try:
            (done,), _ = ray.wait(self.loops, num_returns=1)
            index = self.loops.index(done)
            try:
                ray.get(done)
                how = "exited"
            except ray.exceptions.RayTaskError as e:  # run_worker raised
                cause = e.cause if e.cause is not None else e
                how = f"failed: {type(cause).__name__}: {cause}"
            except ray.exceptions.RayError as e:  # its process or node died (killed, out of memory)
                how = f"died: {_why_dead(e)}"
            return f"tensor-parallel rank {index + 1} ({self._describe(index)}) {how}"
        except Exception as e:  # noqa: BLE001 - this driver lost the cluster: the ranks are as good as dead
            return f"tensor-parallel ranks lost: the Ray cluster is unreachable ({_first_line(e)})"
        finally:
            self._watched.set()

    def _describe(self, index: int) -> str:
        import ray

        try:
            actor_id, ip, pid = ray.get(self.places[index], timeout=1.0)
        except Exception:  # noqa: BLE001 - it died before it could say
            return "Ray actor"
        return f"Ray actor {actor_id}, pid {pid} on node {ip}"

    def _stop_workers(self) -> None:
        import ray

        if not ray.is_initialized():  # never started, or shut down by the application already
            return
        if self.loops:
            ray.wait(self.loops, num_returns=len(self.loops), timeout=STOP_SECONDS)
        for actor in self.actors:  # an actor outlives its loop: killing it frees its bundle's resources
            ray.kill(actor)
        if self.group is not None:
            ray.util.remove_placement_group(self.group)
        if self._owns_ray:
            if self.loops:  # the watcher runs: let it finish its Ray calls first
                self._watched.wait(STOP_SECONDS)
            ray.shutdown()


def _check_reachable(address: str) -> None:
    """Raise ``ConfigError`` unless something listens at ``address`` (``[ray://]host:port``)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    host = host.strip("[]")  # an IPv6 literal
    if not port.isdigit():
        return  # "auto", "local": Ray resolves those
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as e:
        raise ConfigError(f"RAY_ADDRESS={address}: no Ray cluster answers there ({e}); start its head node "
                          "(ray start --head) or fix RAY_ADDRESS") from e


def _why_dead(error: BaseException) -> str:
    """What a ``RayActorError`` says killed the actor ("its worker process has died", "it was killed by
    `ray.kill`", ...): the first sentence of the line that says so, among its many."""
    for line in str(error).splitlines():
        if line.startswith("The actor is dead because "):
            return line.removeprefix("The actor is dead because ").split(". ")[0].rstrip(".")
    return _first_line(error)


def _first_line(error: BaseException) -> str:
    """Ray's errors run to many lines; the first says what happened."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
