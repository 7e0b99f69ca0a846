"""GGUF weights kept in their blocks (``--quantization gguf``, the default for a GGUF on the CPU).

Each supported ggml block type is an exact instance of the packed integer form ``w = scale * q + min`` per group
(heron/quantization/packed_int.py): Q4_0, Q4_1 and Q4_K become 4-bit groups of 32; Q5_0, Q5_1 and Q8_0 8-bit
groups of 32; Q6_K 8-bit groups of 16. A layer with a tensor of another type (F16, Q2_K...) is dequantized to
the model dtype at load instead, with one log line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn

from heron.quantization.base import batch_packed, dense_linear, dense_stack_linear, linear_parameter
from heron.quantization.packed_int import IntShard, PackedIntLinearMethod

logger = logging.getLogger(__name__)

_Q = GGMLQuantizationType


@dataclass
class GGUFWeight:
    """A GGUF tensor in its blocks: ``blocks`` uint8 [rows, bytes per row] of type ``qtype``, ``shape`` [rows,
    cols] of the weight it stands for."""

    blocks: np.ndarray
    qtype: GGMLQuantizationType
    shape: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], by the ``gguf`` package."""
        return torch.from_numpy(dequantize(self.blocks, self.qtype).reshape(self.shape))

    def narrow(self, dim: int, start: int, length: int) -> GGUFWeight:
        """Rows (``dim`` 0) or columns (``dim`` 1, whole blocks only) ``[start, start + length)``: a tensor-
        parallel part, as ``torch.Tensor.narrow``."""
        rows, cols = self.shape
        if dim == 0:
            return GGUFWeight(self.blocks[start:start + length], self.qtype, (length, cols))
        per_block, block_bytes = GGML_QUANT_SIZES[self.qtype]
        if start % per_block or length % per_block:
            raise ValueError(f"{self.qtype.name} blocks hold {per_block} columns: a tensor-parallel part of "
                             f"{length} columns from column {start} would cut through them")
        first = start // per_block * block_bytes
        return GGUFWeight(self.blocks[:, first:first + length // per_block * block_bytes], self.qtype, (rows, length))

    def padded_rows(self, rows: int) -> GGUFWeight:
        """The weight with zero rows appended up to ``rows`` (all-zero blocks: zero scales, so zero weights)."""
        pad = np.zeros((rows - self.shape[0], self.blocks.shape[1]), dtype=self.blocks.dtype)
        return GGUFWeight(np.concatenate([self.blocks, pad]), self.qtype, (rows, self.shape[1]))


def _split(blocks: np.ndarray, *sizes: int) -> list[np.ndarray]:
    """Per-block fields of the given byte sizes (the rest last); blocks: uint8 [n, block bytes]."""
    return np.hsplit(blocks, np.cumsum(sizes))


def _f16(field: np.ndarray) -> np.ndarray:
    return field.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, half: int) -> np.ndarray:
    """Low nibbles then high nibbles of each run of ``half`` bytes: [n, runs * 2 * half] uint8."""
    n = qs.shape[0]
    shifted = qs.reshape(n, -1, 1, half) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (shifted & np.uint8(0x0F)).reshape(n, -1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5's 32 high bits per block, as 0/1 bytes [n, 32]."""
    bits = qh.copy().view(np.uint32).reshape(-1, 1) >> np.arange(32, dtype=np.uint32).reshape(1, 32)
    return (bits & np.uint32(1)).astype(np.uint8)


def _q4_0(b):
    d, qs = _split(b, 2)
    d = _f16(d)
    return _nibbles(qs, 16), d, -8 * d


def _q4_1(b):
    d, m, qs = _split(b, 2, 2)
    return _nibbles(qs, 16), _f16(d), _f16(m)


def _q5_0(b):
    d, qh, qs = _split(b, 2, 4)
    d = _f16(d)
    return _nibbles(qs, 16) | (_fifth_bits(qh) << 4), d, -16 * d


def _q5_1(b):
    d, m, qh, qs = _split(b, 2, 2, 4)
    return _nibbles(qs, 16) | (_fifth_bits(qh) << 4), _f16(d), _f16(m)


def _q8_0(b):
    d, qs = _split(b, 2)
    d = _f16(d)
    return (qs.view(np.int8).astype(np.int16) + 128).astype(np.uint8), d, -128 * d


def _q4_k(b):
    d, dmin, scales, qs = _split(b, 2, 2, 12)
    n = b.shape[0]
    s = scales.reshape(n, 3, 4)  # 6-bit scales and mins of 8 sub-blocks, packed as in ggml's get_scale_min_k4
    lo, hi, extra = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([lo & 0x3F, (extra & 0x0F) | ((lo >> 2) & 0x30)], axis=-1).astype(np.float32)
    mn = np.concatenate([hi & 0x3F, (extra >> 4) | ((hi >> 2) & 0x30)], axis=-1).astype(np.float32)
    return _nibbles(qs, 32), _f16(d) * sc, -(_f16(dmin) * mn)


def _q6_k(b):
    ql, qh, scales, d = _split(b, 128, 64, 16)
    n = b.shape[0]
    low = _nibbles(ql, 64).reshape(n, -1, 32)
    high = qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (high & np.uint8(0x03)).reshape(n, -1, 32)
    scale = _f16(d) * scales.view(np.int8).astype(np.float32)
    return (low | (high << 4)).reshape(n, -1), scale, -32 * scale


# ggml type -> (bits, group, block decoder giving q [blocks, weights], scale and min [blocks, groups])
_DECODERS = {
    _Q.Q4_0: (4, 32, _q4_0), _Q.Q4_1: (4, 32, _q4_1), _Q.Q4_K: (4, 32, _q4_k),
    _Q.Q5_0: (8, 32, _q5_0), _Q.Q5_1: (8, 32, _q5_1), _Q.Q8_0: (8, 32, _q8_0), _Q.Q6_K: (8, 16, _q6_k),
}
KEPT_TYPES = tuple(_DECODERS)


def int_shard(weight: GGUFWeight) -> IntShard:
    """``weight``'s blocks as an exact ``IntShard`` (its type must be one of ``KEPT_TYPES``)."""
    bits, group, decode = _DECODERS[weight.qtype]
    rows, cols = weight.shape
    block_weights, block_bytes = GGML_QUANT_SIZES[weight.qtype]
    q, scale, min_ = decode(np.ascontiguousarray(weight.blocks).reshape(-1, block_bytes))
    as_rows = lambda a: torch.from_numpy(np.ascontiguousarray(a)).reshape(rows, -1)  # noqa: E731
    return IntShard(as_rows(q), as_rows(scale), as_rows(min_), bits, group)


class GGUFLinearMethod(PackedIntLinearMethod):
    """A linear layer whose projections arrive as ``GGUFWeight``s: packed for the integer kernel when every
    projection's type has an exact packed form, else dequantized to the model dtype (a dense layer)."""

    quantizes_lm_head = True  # llama.cpp files quantize the output projection (or the tied embedding)
    tensor_parallel = True  # rows cut anywhere, columns at block boundaries

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        """A placeholder ``weight`` the loader fills with the blocks of each projection (see ``load``); its axes
        are named so that tensor parallelism cuts the blocks (``GGUFWeight.narrow``)."""
        layer.register_parameter("weight", linear_parameter(torch.empty(0, dtype=torch.uint8), output_dim=0,
                                                            input_dim=1))
        layer.gguf_weights = [None] * len(output_sizes)

    def load(self, layer: nn.Module, param: nn.Parameter, loaded, shard_id: int | None) -> None:
        """Keep projection ``shard_id``'s GGUF tensor for ``process_weights_after_loading``."""
        if param is not layer.weight:
            return super().load(layer, param, loaded, shard_id)
        if not isinstance(loaded, GGUFWeight):
            raise ValueError("a GGUF-quantized layer takes GGUF blocks, not a dense tensor")
        index = shard_id or 0
        if loaded.shape != (layer.output_sizes[index], layer.input_size):
            raise ValueError(f"shape mismatch: shard {index} {(layer.output_sizes[index], layer.input_size)} "
                             f"vs checkpoint {loaded.shape}")
        layer.gguf_weights[index] = loaded

    def shards(self, layer: nn.Module) -> list[IntShard]:
        """Each projection's blocks as an exact ``IntShard``."""
        return [int_shard(w) for w in layer.gguf_weights]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Pack the layer, or make it dense when one of its projections has no packed form."""
        weights = layer.gguf_weights
        if all(w.qtype in KEPT_TYPES for w in weights):
            super().process_weights_after_loading(layer)
            layer.packed_types = sorted({w.qtype.name for w in weights})
        else:
            dense = torch.cat([w.dequantize() for w in weights]).to(layer.params_dtype)
            layer.weight = linear_parameter(dense, output_dim=0)
            layer.packed = None
            layer.batch_weight = batch_packed(dense)
            layer.packed_types = []
        del layer.gguf_weights

    def describe(self, layer: nn.Module) -> str | None:
        """The packed layer's path, with its ggml types; a dense layer's: dequantized at load."""
        if layer.packed is None:
            return "GGUF types without a packed form: dequantized at load"
        return f"{'+'.join(layer.packed_types)}: {super().describe(layer)}"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The integer kernel's product, or the dense one for a layer that could not be packed."""
        if layer.packed is None:
            return dense_linear(x, layer.weight, layer.batch_weight, bias)
        return super().apply(layer, x, bias)

    def stack_linear(self, layer: nn.Module, kernels: ModuleType):
        """The packed weight, or the dense one of a layer that could not be packed."""
        if layer.packed is None:
            return dense_stack_linear(layer.weight, layer.batch_weight, layer.bias, kernels)
        return super().stack_linear(layer, kernels)
