"""Weight-only int8 and int4 quantized at load from a full-precision checkpoint (``--quantization int8/int4``).

Each layer is created dense, loaded as usual, then quantized group-wise into heron's packed integer layout
(packed_int.py), which the int8-dot-product kernel multiplies:

- **int8**: symmetric, ``scale = max|w| / 127`` per group of 128 inputs (64 or 32 where 128 does not divide
  them), ``q = round(w / scale)``; stored unsigned as ``q + 128`` with ``min = -128 * scale``.
- **int4**: asymmetric per group of 32 inputs, as llama.cpp's Q4_1: ``scale = (max - min) / 15``,
  ``q = round((w - min) / scale)`` in [0, 15], ``min`` the group's minimum (scales kept in float32).

The LM head is quantized too; a tied head reads the embedding's weight, which the embedding keeps.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import nn

from heron.errors import ModelLoadError
from heron.quantization.base import QuantizationMethod, UnquantizedLinearMethod
from heron.quantization.packed_int import IntShard, PackedIntLinearMethod

INT8_GROUPS = (128, 64, 32)  # the first that divides a layer's inputs
INT4_GROUP = 32


def int8_group(input_size: int) -> int:
    """The int8 group size of a layer with ``input_size`` inputs (a ModelLoadError when none fits)."""
    for group in INT8_GROUPS:
        if input_size % group == 0:
            return group
    raise ModelLoadError(f"int8 quantizes groups of {'/'.join(map(str, INT8_GROUPS))} inputs; a layer with "
                         f"{input_size} inputs has none")


def int4_group(input_size: int) -> int:
    """The int4 group size (32) where it divides ``input_size``, else a ModelLoadError."""
    if input_size % INT4_GROUP:
        raise ModelLoadError(f"int4 quantizes groups of {INT4_GROUP} inputs; a layer has {input_size} inputs")
    return INT4_GROUP


def quantize_int8(weight: torch.Tensor, group: int) -> IntShard:
    """``weight`` [n, k] as symmetric 8-bit groups of ``group`` inputs (see the module docstring)."""
    groups = _grouped(weight, group)
    scales = groups.abs().amax(dim=-1) / 127
    q = torch.round(groups / _nonzero(scales)[..., None]).clamp_(-127, 127) + 128
    return IntShard(q.to(torch.uint8).flatten(1), scales, -128 * scales, 8, group)


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> IntShard:
    """``weight`` [n, k] as asymmetric 4-bit groups of ``group`` inputs (see the module docstring)."""
    groups = _grouped(weight, group)
    mins = groups.amin(dim=-1)
    scales = (groups.amax(dim=-1) - mins) / 15
    q = torch.round((groups - mins[..., None]) / _nonzero(scales)[..., None]).clamp_(0, 15)
    return IntShard(q.to(torch.uint8).flatten(1), scales, mins, 4, group)


def _grouped(weight: torch.Tensor, group: int) -> torch.Tensor:
    """float32 [n, k / group, group]."""
    return weight.detach().float().view(weight.shape[0], -1, group)


def _nonzero(scales: torch.Tensor) -> torch.Tensor:
    """Scales to divide by: a constant group has scale 0, and every q of it 0 (w = min exactly)."""
    return torch.where(scales > 0, scales, torch.ones_like(scales))


class _QuantizedAtLoad(PackedIntLinearMethod):
    """A dense ``weight`` loaded from the checkpoint, quantized projection by projection once loaded."""

    quantizes_lm_head = True
    tensor_parallel = True  # quantized after the loader cut the dense weight to this rank's part

    @abstractmethod
    def group_size(self, input_size: int) -> int:
        """The group size of a layer with ``input_size`` inputs (a ModelLoadError where none fits)."""

    @abstractmethod
    def quantize(self, weight: torch.Tensor, group: int) -> IntShard:
        """One projection's weight [n, k] in the format."""

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        """Register the dense ``weight`` [sum(output_sizes), input_size], as an unquantized layer does."""
        self.group_size(input_size)  # refuse a layer the format cannot take before anything is loaded
        UnquantizedLinearMethod().create_weights(layer, input_size, output_sizes, params_dtype)

    def shards(self, layer: nn.Module) -> list[IntShard]:
        """Each projection's rows of ``weight``, quantized."""
        group = self.group_size(layer.input_size)
        return [self.quantize(w, group) for w in layer.weight.split(layer.output_sizes)]


class Int8LinearMethod(_QuantizedAtLoad):
    """``--quantization int8``: symmetric 8-bit weights per group of 128 (or 64/32) inputs."""

    def group_size(self, input_size: int) -> int:
        return int8_group(input_size)

    def quantize(self, weight: torch.Tensor, group: int) -> IntShard:
        return quantize_int8(weight, group)


class Int4LinearMethod(_QuantizedAtLoad):
    """``--quantization int4``: asymmetric 4-bit weights per group of 32 inputs (llama.cpp's Q4_1); the LM head
    in int8, as llama.cpp's 4-bit files keep their output layer in 6 or 8 bits (the default model's perplexity:
    +6.0% against bf16 with a 4-bit head, +0.3% with an 8-bit one; docs/benchmarks.md)."""

    @classmethod
    def for_layer(cls, quant_config: dict, layer: str) -> QuantizationMethod:
        """Int8 for the LM head, this method for every other linear layer."""
        return Int8LinearMethod() if layer == "lm_head" else cls()

    def group_size(self, input_size: int) -> int:
        return int4_group(input_size)

    def quantize(self, weight: torch.Tensor, group: int) -> IntShard:
        return quantize_int4(weight, group)
