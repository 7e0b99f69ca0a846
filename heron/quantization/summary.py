"""What a loaded model's weights cost and which matmul paths they take: the weights part of the start log."""

from __future__ import annotations

from collections import Counter

from torch import nn

from heron.layers.linear import LinearBase


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights as served: parameters and packed integer weights."""
    weights = sum(p.nbytes for p in {id(p): p for p in model.parameters()}.values())
    return weights + sum(m.packed.nbytes for m in model.modules() if getattr(m, "packed", None) is not None)


def copy_bytes(model: nn.Module) -> int:
    """Bytes of the linear layers' second copies (a dense weight's packed layout for many rows, an integer weight's
    bfloat16 or 8-bit copy for prompt chunks)."""
    copies = (getattr(m, name, None) for m in model.modules() for name in ("batch_weight", "prompt_weight"))
    return sum(t.nbytes for t in copies if t is not None)


def describe_weights(model: nn.Module) -> str:
    """E.g. "weights 147.7 MiB; linear layers: 120 Q4_1: int8-dot kernel (AVX-512 VNNI); 1 Q8_0: ..."."""
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    paths = Counter(m.quant_method.describe(m) or "dense" for m in linears)
    layers = "; ".join(f"{n} {path}" for path, n in paths.items())
    copies = copy_bytes(model)
    extra = f" (+{copies / 2**20:.1f} MiB of copies for prompt tokens or many rows)" if copies else ""
    return f"weights {weight_bytes(model) / 2**20:.1f} MiB{extra}; linear layers: {layers}"
