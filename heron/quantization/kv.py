"""The fp8 KV cache (``--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2``): one byte per key or value element.

A key is stored as ``k / k_scale`` rounded to the float8 format, saturated to its finite range (so an outlier
costs precision, never a NaN or an infinity), and read back as ``stored * k_scale``; likewise values. Scales
are per tensor: one for the keys and one for the values of each layer, 1.0 by default, or, with
``--calculate-kv-scales``, set once from the first batch a layer stores as vLLM sets them
(``max|k| / K_SCALE_CONSTANT``, ``max|v| / V_SCALE_CONSTANT``: the first batch's largest key lands at 200 of
e4m3's 448, leaving room for larger ones later). The activations keep the model's dtype; only the pool changes.

These are the PyTorch forms, used by the reference backend; the CPU kernels (``kernels/csrc``) store the same
bytes and read back the same values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from heron.errors import ConfigError

if TYPE_CHECKING:
    from heron.attention.backend import AttentionBackend

# --kv-cache-dtype -> torch dtype name; "fp8" is e4m3 (more mantissa, less range), as in vLLM
FP8_KV_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
K_SCALE_CONSTANT = 200.0  # vLLM's defaults (envs.K_SCALE_CONSTANT, V_SCALE_CONSTANT)
V_SCALE_CONSTANT = 100.0


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, backend: AttentionBackend) -> torch.dtype:
    """The pool's dtype for ``--kv-cache-dtype name``: ``auto`` is the model's; an fp8 name is its float8 dtype,
    or a ConfigError where this torch has none or ``backend`` cannot read one."""
    if name == "auto":
        return model_dtype
    dtype = getattr(torch, FP8_KV_CACHE_DTYPES[name], None)
    if dtype is None:
        raise ConfigError(f"--kv-cache-dtype {name} needs a torch with float8 dtypes (2.1 or newer; this is "
                          f"{torch.__version__}); upgrade torch or use --kv-cache-dtype auto")
    if not backend.supports_fp8_kv:
        raise ConfigError(f"the {backend.name} attention backend cannot read an fp8 KV cache; choose another "
                          "--attention-backend (reference, cpu_paged) or use --kv-cache-dtype auto")
    return dtype


_FP8_DTYPES = {d for name in set(FP8_KV_CACHE_DTYPES.values()) if (d := getattr(torch, name, None)) is not None}


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of the float8 formats a KV pool may hold."""
    return dtype in _FP8_DTYPES


@dataclass(frozen=True)
class KVScales:
    """One layer's per-tensor scales: a float8 pool stores ``key / k`` and ``value / v``."""

    k: float = 1.0
    v: float = 1.0

    @classmethod
    def from_batch(cls, key: torch.Tensor, value: torch.Tensor) -> KVScales:
        """vLLM's ``calc_kv_scales``: ``max|key| / K_SCALE_CONSTANT``, ``max|value| / V_SCALE_CONSTANT``. A tensor
        of zeros (or one holding a non-finite value) keeps 1.0: its scale would turn every later entry into NaN."""
        return cls(_scale(key, K_SCALE_CONSTANT), _scale(value, V_SCALE_CONSTANT))


def _scale(x: torch.Tensor, constant: float) -> float:
    amax = x.abs().max().item() if x.numel() else 0.0
    return amax / constant if 0 < amax < math.inf else 1.0


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` as stored in a pool of ``dtype``: for float8, ``x / scale`` (in float32) saturated to the format's
    finite range, then rounded to nearest even; for any other dtype, ``x`` cast."""
    if not is_fp8(dtype):
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Entries of a pool read back as ``dtype``: ``x * scale`` (the multiply skipped when the scale is 1.0)."""
    x = x.to(dtype)
    return x if scale == 1.0 else x * scale
