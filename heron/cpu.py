"""What the CPU can do, detected at run time (the machines heron runs on differ: AMX on some, AVX-512 BF16 on
others, neither on many)."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

# ISA flags with native bfloat16 arithmetic: AVX-512 BF16 (Cooper Lake, Zen 4+) and AMX (Sapphire Rapids+)
_NATIVE_BF16 = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The ISA flags of this machine's CPU (empty where /proc/cpuinfo is not available)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_native_bf16() -> bool:
    """Whether bfloat16 matmuls run natively here (so bfloat16 weights are faster, not emulated)."""
    return any(flag in cpu_flags() for flag in _NATIVE_BF16)


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask: a container's or taskset's limit, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.lru_cache(maxsize=1)
def torch_default_threads() -> int:
    """torch's own intra-op default (one thread per physical core), read before heron changes it."""
    import torch

    return torch.get_num_threads()


def engine_threads(requested: int | None, serving: bool, ranks: int = 1) -> int:
    """Intra-op threads for the engine core (and for each of ``ranks`` tensor-parallel ranks on this machine):
    ``requested`` (or ``HERON_CPU_THREADS``), else torch's default within the usable cores, less one for the API
    process when serving on 4 or more, shared out among the ranks. On fewer, taking a core from a 2-core core
    costs more than the API process's contention does (docs/performance.md)."""
    if requested is None and os.environ.get("HERON_CPU_THREADS"):
        requested = int(os.environ["HERON_CPU_THREADS"])
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--cpu-threads must be at least 1, got {requested}")
        return requested
    cores = min(usable_cores(), torch_default_threads())
    cores = cores - 1 if serving and cores >= 4 else cores
    return max(1, cores // ranks)


def set_engine_threads(requested: int | None, serving: bool, ranks: int = 1) -> int:
    """Apply ``engine_threads`` to torch's intra-op pool (and heron's kernels, which share it); returns it."""
    import torch

    threads = engine_threads(requested, serving, ranks)
    torch.set_num_threads(threads)
    logger.info("engine core: %d CPU threads (of %d usable cores%s)", threads, usable_cores(),
                "; set with --cpu-threads" if requested is None else "")
    return threads


def total_memory() -> int:
    """Bytes of physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_memory() -> int:
    """Bytes of physical memory not in use now (MemAvailable: free plus reclaimable caches)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
