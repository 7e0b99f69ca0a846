"""heron's own CPU kernels: a C++ extension built with ``torch.utils.cpp_extension`` at first use.

The extension (``csrc/*.cpp``) holds the paged-attention kernel, the fused small ops of a decoder layer
(residual + RMSNorm, RoPE, SwiGLU, the KV-pool write), a bfloat16 one-row matmul, the integer-weight matmul, an
bfloat16 matmul whose rows do not depend on their batch (AMX tiles or AVX-512 BF16), and the decoder stack that runs a model's layers from them in one call (heron/model/decoder_stack.py). It is compiled for this
CPU (``-march=native``) and cached under heron's cache directory, keyed by the sources, their directory, torch's
version and the CPU's flags. Where it cannot be built (no compiler) ``cpu_kernels()`` is None after one warning and the layers
use their PyTorch form; ``HERON_CPU_KERNELS=0`` forces that form (to compare against it).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from heron.cpu import cpu_flags

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = sorted(_CSRC.glob("*.cpp"))
# -fno-trapping-math: GCC leaves loops with float comparisons (min, max, selects) scalar without it; no result
# changes (heron never reads the floating-point exception flags)
_CFLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp"]


def build_dir_of(csrc: Path) -> Path:
    """Where the extension of the sources in ``csrc`` is built: keyed by their bytes, their directory, torch's
    version and this CPU's flags. The directory too, because torch rebuilds a build directory whose include path
    changed: two checkouts of the same sources sharing one would rebuild it each time the other loads it
    (minutes, under the build lock)."""
    from heron.model.default_model import heron_cache_dir

    digest = hashlib.sha256(torch.__version__.encode() + " ".join(sorted(cpu_flags()) + _CFLAGS).encode())
    digest.update(str(csrc).encode())
    for source in sorted(csrc.glob("*.[ch]*")):  # the headers too
        digest.update(source.read_bytes())
    return heron_cache_dir() / "kernels" / f"cpu-{digest.hexdigest()[:16]}"


@functools.lru_cache(maxsize=1)
def load_cpu_kernels() -> ModuleType:
    """The compiled extension (built once per source, torch version and CPU; then loaded from the cache).
    Raises when it cannot be built."""
    from torch.utils.cpp_extension import load

    build_dir = build_dir_of(_CSRC)
    build_dir.mkdir(parents=True, exist_ok=True)
    logger.info("loading heron's CPU kernels (compiled into %s on first use)", build_dir)
    # torch's own build lock is a file that waits forever once a process dies holding it (a server killed while
    # compiling); heron's is an flock the kernel drops with its holder, and whoever holds it removes torch's
    with open(build_dir / "heron.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        return load(name="heron_cpu_kernels", sources=[str(s) for s in _SOURCES], build_directory=str(build_dir),
                    extra_include_paths=[str(_CSRC)], extra_cflags=_CFLAGS,
                    extra_ldflags=["-fopenmp"], verbose=False)


@functools.lru_cache(maxsize=1)
def cpu_kernels() -> ModuleType | None:
    """The extension, or None (after one warning) where it cannot be built or ``HERON_CPU_KERNELS=0``."""
    if os.environ.get("HERON_CPU_KERNELS", "1") == "0":
        return None
    try:
        return load_cpu_kernels()
    except Exception as e:  # noqa: BLE001 - no compiler, a broken toolchain: fall back to PyTorch ops
        logger.warning("heron's CPU kernels could not be built (%s); using PyTorch ops instead", e)
        return None


def kernels_for(t: torch.Tensor) -> ModuleType | None:
    """The CPU kernels when ``t`` lives on the CPU and they are available, else None."""
    return cpu_kernels() if t.is_cpu else None  # is_cpu: ~6x cheaper than device.type (called ~150x a step)
