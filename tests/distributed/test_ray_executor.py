"""``--distributed-executor-backend ray``: tensor-parallel ranks as Ray actors, on a two-node Ray cluster that
the tests start on this machine with the ``ray`` CLI (a head node with no CPUs, so that the rank's actor runs
on the second node, as it would on a second machine)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from heron import LLM, SamplingParams
from heron.config import EngineConfig
from heron.distributed import ray_executor
from heron.errors import ConfigError, WorkerDiedError

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

PROMPTS = ["Hello, world!", "The quick brown fox", "def add(a, b):"]
GREEDY = SamplingParams(max_tokens=16, temperature=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_start(*args: str, env: dict, log: Path) -> subprocess.Popen:
    """``ray start --block ...`` in its own session: terminating it stops that node's processes, and only
    those (``ray stop`` would stop every Ray node on the machine)."""
    ray_cli = Path(sys.executable).with_name("ray")
    with log.open("w") as out:
        return subprocess.Popen([str(ray_cli), "start", "--block", *args], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _stop(node: subprocess.Popen) -> None:
    node.terminate()
    try:
        node.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(node.pid, signal.SIGKILL)
        node.wait()


@pytest.fixture(scope="module")
def ray_cluster():
    """A head node (0 CPUs) and a worker node (1 CPU) on this machine; yields the head's address, which
    ``RAY_ADDRESS`` names while the module's tests run."""
    port = _free_port()
    address = f"127.0.0.1:{port}"
    temp_dir = tempfile.mkdtemp(prefix="heron-ray-")  # short: Ray's socket paths live under it
    # Ray reads RAY_AUTH_MODE once, at import: the nodes take this process's (token auth off unless it is on
    # here), so that a token in ~/.ray does not make the nodes and this driver disagree
    auth = {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"), "RAY_USAGE_STATS_ENABLED": "0"}
    env = {**os.environ, **auth}
    nodes = [_ray_start("--head", f"--port={port}", "--num-cpus=0", "--include-dashboard=false",
                        f"--temp-dir={temp_dir}", env=env, log=Path(temp_dir, "head.log"))]
    try:
        deadline = time.monotonic() + 120
        while True:  # the head's GCS listens once it is up
            assert nodes[0].poll() is None, Path(temp_dir, "head.log").read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the Ray head node did not start"
                time.sleep(0.5)
        nodes.append(_ray_start(f"--address={address}", "--num-cpus=1", env=env,
                                log=Path(temp_dir, "worker.log")))
        with pytest.MonkeyPatch.context() as mp:
            for key, value in {**auth, "RAY_ADDRESS": address}.items():
                mp.setenv(key, value)
            yield address
            if ray.is_initialized():  # the test process joined as a driver: leave before the nodes go
                ray.shutdown()
    finally:
        for node in reversed(nodes):
            _stop(node)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _greedy(path: Path, **engine_args) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", cpu_threads=1, **engine_args)
    try:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.engine.shutdown()


def _within(seconds: float, fn):
    """``fn()``'s result (or raise its exception), failing the test if it takes longer than ``seconds``."""
    box: dict = {}

    def call() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            box["error"] = e

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["result"]


def test_ray_ranks_generate_what_one_rank_and_mp_ranks_do(ray_cluster, tiny_model_dir):
    path = tiny_model_dir("llama")
    expected = _greedy(path)
    assert _greedy(path, tensor_parallel_size=2, distributed_executor_backend="mp") == expected

    llm = LLM(str(path), dtype="float32", cpu_threads=1, tensor_parallel_size=2,
              distributed_executor_backend="ray")
    try:
        executor = llm.engine.core.executor
        assert isinstance(executor, ray_executor.RayExecutor)
        head = next(n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"])
        (node,) = ray.util.placement_group_table(executor.group)["bundles_to_node_id"].values()
        assert node != head, "rank 1 should run on the worker node: the head node has no CPUs"
        got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    assert got == expected
    deadline = time.monotonic() + 30  # Ray frees a removed group's resources asynchronously
    while ray.available_resources().get("CPU") != 1:
        assert time.monotonic() < deadline, f"the rank's bundle is still held: {ray.available_resources()}"
        time.sleep(0.2)


def test_a_cluster_too_small_is_a_config_error(ray_cluster, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(ray_executor, "PLACEMENT_TIMEOUT", 2.0)
    with pytest.raises(ConfigError, match=r"cannot place 2 tensor-parallel rank\(s\).*1 CPUs \(1 free\)"):
        LLM(str(tiny_model_dir("llama")), dtype="float32", cpu_threads=1, tensor_parallel_size=3,
            distributed_executor_backend="ray")
    assert ray.util.placement_group_table() == {} or all(
        group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())


def test_a_killed_rank_fails_the_next_generate_at_once(ray_cluster, tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", cpu_threads=1, tensor_parallel_size=2,
              distributed_executor_backend="ray")
    try:
        assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        _, _, pid = ray.get(llm.engine.core.executor.places[0])
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match=rf"rank 1 \(Ray actor \w+, pid {pid} on node .*\) died"):
            _within(30, lambda: llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False))
    finally:
        _within(30, llm.engine.shutdown)


def test_a_rank_that_raises_is_reported_with_its_error(ray_cluster, tiny_model_dir):
    ray.init(ignore_reinit_error=True)  # RAY_ADDRESS: the module's cluster

    @ray.remote(num_cpus=0)
    def failing_rank() -> None:
        raise MemoryError("no room for the shard")

    config = EngineConfig(model=str(tiny_model_dir("llama")), tensor_parallel_size=2,
                          distributed_executor_backend="ray")
    executor = ray_executor.RayExecutor(config, threads=1)
    executor.loops, executor.places = [failing_rank.remote()], [ray.put(("a1b2", "10.0.0.2", 4242))]
    assert _within(30, executor._wait_for_death) == (
        "tensor-parallel rank 1 (Ray actor a1b2, pid 4242 on node 10.0.0.2) failed: MemoryError: no room for "
        "the shard")
