"""What the CPU can do, detected at run time (the machines heron runs on differ: AMX on some, AVX-512 BF16 on
others, neither on many)."""

from __future__ import annotations

import functools
from pathlib import Path

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
