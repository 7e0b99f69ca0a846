"""One tensor-parallel rank: its shard of the model and of the KV pool (``load_runner``), and, for ranks
1..N-1, the loop that makes each runner call rank 0 mirrors to it (``serve_rank``).

Rank 0 is the engine core's own runner; the executor (``heron/distributed/executor.py``) starts the other
ranks, in processes of this machine or as Ray actors, each running ``run_worker``.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from heron.attention.backend import AttentionBackend, get_attention_backend
from heron.config import EngineConfig
from heron.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel, receive_command
from heron.engine.memory import resolve_device, resolve_dtype, resolve_max_model_len
from heron.model.loader import LoadedModel, load_model
from heron.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

SHUTDOWN = None  # the command that ends a worker's loop


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The device of rank ``rank``: its own GPU on CUDA, else the CPU."""
    device = resolve_device(config.device)
    return torch.device("cuda", rank) if device.type == "cuda" else device


def load_runner(config: EngineConfig, device: torch.device, dtype: torch.dtype, backend: AttentionBackend
                ) -> tuple[LoadedModel, ModelRunner, int]:
    """Load this rank's shard of the model and build its runner; also returns the resolved max_model_len."""
    loaded = load_model(config.model, dtype, device, config.max_model_len, config.tokenizer, config.chat_template,
                        config.quantization)
    max_model_len = resolve_max_model_len(config, loaded.hf_config)
    runner = ModelRunner(loaded.model, config.block_size, device, config.max_num_seqs, max_model_len,
                         config.max_num_batched_tokens, backend)
    return loaded, runner, max_model_len


def run_worker(config: EngineConfig, rank: int, size: int, init_method: str, threads: int,
               log_level: int = logging.INFO, receive: Callable[[], Any] = receive_command,
               shm_path: str | None = None) -> None:
    """Main of rank ``rank`` > 0: join the group, load the shard, say so (a barrier rank 0 waits on), then make
    the calls rank 0 sends (``receive`` gets the next one) until ``SHUTDOWN``. Raises whatever fails; the
    executor reports it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: rank 0 decides
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    torch.set_num_threads(threads)
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_tensor_parallel(rank, size, init_method, "nccl" if device.type == "cuda" else "gloo", shm_path)
    try:
        dtype = resolve_dtype(config.dtype, device)
        backend = get_attention_backend(config.attention_backend, device)
        _, runner, _ = load_runner(config, device, dtype, backend)
        dist.barrier()
        logger.info("tensor-parallel rank %d of %d ready (pid %d, %d CPU threads)", rank, size, os.getpid(), threads)
        serve_rank(runner, receive)
    finally:
        destroy_tensor_parallel()


def serve_rank(runner: ModelRunner, receive: Callable[[], Any]) -> None:
    """Make each call rank 0 sends, until ``SHUTDOWN``."""
    while (command := receive()) is not SHUTDOWN:
        method, args, kwargs = command
        args = (a.to(runner.device) if isinstance(a, torch.Tensor) else a for a in args)
        getattr(runner, method)(*args, **kwargs)
