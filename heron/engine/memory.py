"""Device and dtype selection, and how many KV blocks fit in the memory budget."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from heron.config import EngineConfig
from heron.cpu import has_native_bf16, total_memory
from heron.errors import ConfigError

logger = logging.getLogger(__name__)

GiB = 1 << 30
_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when a GPU is present, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA GPU is available; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on a GPU that has it (else float16); on the CPU bfloat16 where the CPU computes it
    natively (AVX-512 BF16 or AMX: half the weight bytes per token), else float32 (emulated bfloat16 is slower).
    ``--dtype float32`` keeps outputs equal to a float32 reference."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if has_native_bf16() else torch.float32


def cpu_default_kv_bytes(memory_bytes: int | None = None) -> int:
    """The CPU's default KV budget: a tenth of the machine's memory, between 1 and 4 GiB (vLLM's CPU backend
    takes 4 GiB by default). Pages are only touched as blocks fill, so an idle pool costs little; a pool too
    small for the batch costs preemptions, and their recomputed prompts (15% of offline throughput with 256
    requests at 1 GiB, docs/performance.md)."""
    total = total_memory() if memory_bytes is None else memory_bytes
    return min(4 * GiB, max(GiB, total // 10 // GiB * GiB))


def kv_cache_budget(config: EngineConfig, device: torch.device, activation_peak_bytes: int = 0,
                    mem_get_info: Callable[[], tuple[int, int]] | None = None) -> int:
    """Bytes the KV pool may take.

    CPU: ``--kv-cache-memory`` (default ``cpu_default_kv_bytes()``). CUDA: ``--kv-cache-memory`` if given, else
    ``gpu_memory_utilization * total - used_now - activation_peak``, where ``used_now`` is measured after
    the weights are loaded and ``activation_peak`` by a profiling forward.
    """
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    if device.type != "cuda":
        return cpu_default_kv_bytes()
    free, total = (mem_get_info or torch.cuda.mem_get_info)()
    budget = int(total * config.gpu_memory_utilization) - (total - free) - activation_peak_bytes
    if budget <= 0:
        raise ConfigError(
            f"no GPU memory left for the KV cache: {config.gpu_memory_utilization:.0%} of "
            f"{total / 2**30:.1f} GiB is already taken by weights and activations; raise "
            "--gpu-memory-utilization or lower --max-num-batched-tokens")
    return budget


def num_kv_blocks(config: EngineConfig, budget_bytes: int, bytes_per_block: int, max_model_len: int) -> int:
    """Blocks that fit the budget, capped at what ``max_num_seqs`` full-length sequences could ever use."""
    if config.num_gpu_blocks_override:
        return config.num_gpu_blocks_override
    blocks = budget_bytes // bytes_per_block
    cap = config.max_num_seqs * -(-max_model_len // config.block_size)
    if blocks < 1:
        raise ConfigError(f"the KV-cache budget ({budget_bytes} bytes) holds no block of {bytes_per_block} "
                          "bytes; raise --kv-cache-memory")
    return min(blocks, cap)


def check_kv_capacity(num_blocks: int, block_size: int, max_model_len: int, bytes_per_block: int,
                      kv_dtype: torch.dtype) -> None:
    """Refuse a pool that cannot hold one ``max_model_len`` sequence: such a sequence could never finish.

    The message says what to change (as vLLM's does): more KV memory, one-byte (fp8) KV elements where they are
    wider, or a shorter ``--max-model-len``.
    """
    needed = -(-max_model_len // block_size)
    if num_blocks >= needed:
        return
    fits = num_blocks * block_size
    fp8 = (f", --kv-cache-dtype fp8: {kv_dtype.itemsize}x the tokens of a {str(kv_dtype).removeprefix('torch.')} "
           "pool" if kv_dtype.itemsize > 1 else "")
    raise ConfigError(
        f"the KV cache holds {fits} tokens ({num_blocks} blocks of {block_size}), but one sequence of "
        f"--max-model-len {max_model_len} needs {needed} blocks ({needed * bytes_per_block / 2**20:.1f} MiB): "
        f"raise --kv-cache-memory (or --gpu-memory-utilization, --num-gpu-blocks-override{fp8}), or lower "
        f"--max-model-len to at most {fits}")


def resolve_max_model_len(config: EngineConfig, hf_config) -> int:
    """``--max-model-len``, or the model's own maximum; refused if above the latter."""
    model_max = getattr(hf_config, "max_position_embeddings", None) or 4096
    if config.max_model_len is None:
        return model_max
    if config.max_model_len > model_max:
        raise ConfigError(f"--max-model-len {config.max_model_len} exceeds the model's maximum of {model_max}")
    return config.max_model_len
