"""Integer weights in the layout of heron's int8-dot-product kernel, shared by every integer format.

Any block format whose weights are ``w[n, k] = scale[n, g] * q[n, k] + min[n, g]`` (g = k // group, q an
unsigned integer) lands here exactly: GGUF's Q4_0/Q4_1/Q8_0/Q4_K/Q6_K, heron's own int8/int4, AWQ and GPTQ. A
format only turns its checkpoint tensors into ``IntShard``s; this module packs them and multiplies.

The packed layout (``PackedInt``) is the one the kernel streams: 16 output rows side by side, 4 consecutive
inputs per row in one 32-bit lane, so one AVX-512 VNNI instruction multiplies 16 rows x 4 inputs by 4 int8
activations. 8-bit: ``qweight[N/16, K/4, 16, 4]``; 4-bit: ``qweight[N/16, K/8, 16, 4]`` whose byte j of a lane
holds input j in its low nibble and input j+4 in its high nibble. Scales and mins are ``[N/16, K/group, 16]``
(float16 where every value is exactly float16, else float32), the 16 rows of a group side by side. N is
padded to 16 and K to the kernel's block (rows and inputs of zeros that add nothing). ``dequantize`` is the
reference the kernel is tested against.

Where the CPU has AMX and the model computes in bfloat16, a layer also keeps its weight dequantized to bfloat16
in the tile layout of heron's bfloat16 matmul (``prompt_weight``, ``kernels.tile_linear``) for a step's prompt
rows (heron/layers/prompt_rows.py): AMX's bfloat16 tiles multiply many rows several times faster than the integer
kernel, which wins at a few rows (it reads a quarter of the bytes): generated tokens keep it. Each of
tile_linear's outputs is one float32 sum in a fixed order, so a row's result is the same whatever its batch,
chunking or prefix-cache hits (tested), with all of a step's prompt rows in one call (oneDNN's GEMM, whose
blocking and so a row's last bits follow the number of rows, needed calls of a fixed size, the last one padded:
2.5x slower at 512 rows). The copy costs the memory of a bfloat16 model.

Without AMX but with AVX-512 VNNI (AMD Zen 4 and 5) the integer kernel's VNNI loop beats tile_linear's AVX-512 BF16
vectors at every row count, but a block format's float epilogue (a scale and a min per 32 weights) takes ~30% of
its ``VPDPBUSD`` rate (``benchmarks/bench_dot_peak.py``). There prompt rows take an 8-bit copy with one scale and
min per output row instead (``row_scale_copy``, ``kernels.int_linear_row_scale``: per 32 inputs a convert and one
FMA): 1.15-1.2x the multiply-adds per second of the 4-bit layout at 512 rows, the same arithmetic for every row
count. It costs 8 bits a weight (+102 MiB for the default model). ``HERON_PROMPT_WEIGHTS=1`` asks for the bfloat16
copy instead wherever tile_linear runs; ``HERON_PROMPT_WEIGHTS=0`` (or too little free memory) leaves either out,
and every row takes the integer kernel.
"""

from __future__ import annotations

import math
import os
from abc import abstractmethod
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from heron.cpu import cpu_flags
from heron.kernels import cpu_kernels, kernels_for
from heron.layers.prompt_rows import current_rows
from heron.quantization.base import QuantizationMethod, copy_fits, tile_kernel, tile_packed

ROWS = 16  # output rows per packed tile: one AVX-512 register of int32 lanes
ACT_BLOCK = 32  # inputs per activation quantization block (the kernel's int8 x; as llama.cpp's q8 blocks)


@dataclass
class IntShard:
    """One projection's integer weight: ``w[n, k] = scales[n, k // group] * q[n, k] + mins[n, k // group]``."""

    q: torch.Tensor  # uint8 [n, K], each value < 2**bits
    scales: torch.Tensor  # float32 [n, K // group]
    mins: torch.Tensor  # float32 [n, K // group]
    bits: int  # 4 or 8
    group: int

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if self.bits not in (4, 8):
            raise ValueError(f"integer weights have 4 or 8 bits, not {self.bits}")
        if not valid_group(self.group) or k % self.group:
            raise ValueError(f"group size {self.group} does not fit {k} inputs (16, 32 or a multiple of 32 "
                             "dividing them)")
        if self.scales.shape != (n, k // self.group) or self.mins.shape != self.scales.shape:
            raise ValueError(f"scales {tuple(self.scales.shape)} / mins {tuple(self.mins.shape)} do not match "
                             f"{n} rows of {k // self.group} groups")

    def with_group(self, group: int) -> IntShard:
        """The same weight with scales repeated to a smaller ``group`` dividing this one."""
        if self.group % group:
            raise ValueError(f"cannot split groups of {self.group} into groups of {group}")
        times = self.group // group
        return IntShard(self.q, self.scales.repeat_interleave(times, dim=1),
                        self.mins.repeat_interleave(times, dim=1), self.bits, group)

    def with_bits(self, bits: int) -> IntShard:
        """The same weight stored in ``bits`` >= its own (4-bit values fit 8-bit lanes unchanged)."""
        if bits < self.bits:
            raise ValueError(f"cannot store {self.bits}-bit values in {bits} bits")
        return IntShard(self.q, self.scales, self.mins, bits, self.group)

    def dequantize(self) -> torch.Tensor:
        """float32 [n, K], each value rounded once (computed in float64: exact for every format's products)."""
        scales = self.scales.double().repeat_interleave(self.group, dim=1)
        mins = self.mins.double().repeat_interleave(self.group, dim=1)
        return (self.q.double() * scales + mins).float()


def valid_group(group: int) -> bool:
    """Group sizes the kernel takes: 16, 32, or a multiple of 32 (an int32 sum never spans two x blocks)."""
    return group in (16, 32) or (group > 0 and group % ACT_BLOCK == 0)


@dataclass
class PackedInt:
    """An integer weight of ``n`` x ``k`` in the kernel's layout (see the module docstring)."""

    qweight: torch.Tensor  # uint8 [N/16, K*bits/32, 16, 4]
    scales: torch.Tensor  # float32 or float16 [N/16, K/group, 16]
    mins: torch.Tensor  # same
    bits: int
    group: int
    n: int  # output rows before padding
    k: int  # inputs before padding

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes + self.mins.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [n, k] in ``dtype`` (the reference of the kernel, and its fallback)."""
        return unpack(self).dequantize()[: self.n, : self.k].to(dtype)


def merge(shards: list[IntShard]) -> IntShard:
    """Shards of one merged layer (q/k/v, gate/up) stacked along the rows, in the widest bits and finest
    group among them (a Q4_K + Q6_K layer becomes 8-bit groups of 16, exactly)."""
    bits = max(s.bits for s in shards)
    group = math.gcd(*(s.group for s in shards))
    if not valid_group(group):
        raise ValueError(f"shards with groups {[s.group for s in shards]} have no common group the kernel takes")
    shards = [s.with_bits(bits).with_group(group) for s in shards]
    return IntShard(torch.cat([s.q for s in shards]), torch.cat([s.scales for s in shards]),
                    torch.cat([s.mins for s in shards]), bits, group)


def pack(shard: IntShard) -> PackedInt:
    """``shard`` in the kernel's layout."""
    n, k = shard.q.shape
    k_block = max(shard.group, ACT_BLOCK)
    n_pad, k_pad = -n % ROWS, -k % k_block
    q = torch.nn.functional.pad(shard.q, (0, k_pad, 0, n_pad))
    scales = torch.nn.functional.pad(shard.scales, (0, k_pad // shard.group, 0, n_pad))
    mins = torch.nn.functional.pad(shard.mins, (0, k_pad // shard.group, 0, n_pad))
    tiles, kp = q.shape[0] // ROWS, q.shape[1]
    if shard.bits == 8:
        qweight = q.view(tiles, ROWS, kp // 4, 4).transpose(1, 2)
    else:  # inputs 8i..8i+3 in the low nibbles, 8i+4..8i+7 in the high ones
        q = q.view(tiles, ROWS, kp // 8, 2, 4)
        qweight = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).transpose(1, 2)
    # float16 scales where they are exactly float16 (GGUF's Q4_0/Q4_1/Q8_0): a sixth fewer bytes per 4-bit weight
    dtype = torch.float16 if _exact_in_half(scales) and _exact_in_half(mins) else torch.float32
    return PackedInt(qweight.contiguous(), _tile_rows(scales, dtype), _tile_rows(mins, dtype), shard.bits,
                     shard.group, n, k)


def unpack(packed: PackedInt) -> IntShard:
    """The padded shard ``packed`` was made from (the inverse of ``pack``)."""
    tiles = packed.qweight.shape[0]
    if packed.bits == 8:
        q = packed.qweight.transpose(1, 2).reshape(tiles * ROWS, -1)
    else:
        lanes = packed.qweight.transpose(1, 2)  # [tiles, 16, K/8, 4]
        q = torch.stack([lanes & 15, lanes >> 4], dim=3).reshape(tiles * ROWS, -1)
    return IntShard(q, _untile_rows(packed.scales), _untile_rows(packed.mins), packed.bits, packed.group)


def _exact_in_half(t: torch.Tensor) -> bool:
    return torch.equal(t.half().float(), t.float())


def _tile_rows(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, G] -> [N/16, G, 16] in ``dtype``."""
    return t.to(dtype).view(-1, ROWS, t.shape[1]).transpose(1, 2).contiguous()


def _untile_rows(t: torch.Tensor) -> torch.Tensor:
    return t.float().transpose(1, 2).reshape(-1, t.shape[1])


PromptWeight = torch.Tensor | PackedInt  # tile_linear's bfloat16 copy, or an 8-bit copy with a scale per row


def linear(x: torch.Tensor, packed: PackedInt, bias: torch.Tensor | None = None,
           prompt_weight: PromptWeight | None = None, float_output: bool = False) -> torch.Tensor:
    """``x W^T + bias`` for a packed integer W: heron's kernel on the CPU (each row's result is the same in any
    batch), except a step's prompt rows where W has a ``prompt_weight`` (``prompt_linear``); W dequantized to
    x's dtype for a dense matmul without the kernels (no compiler, another device). ``float_output``: the
    kernel's float32 sums as they are, not rounded to x's dtype (it quantizes x the same from float32)."""
    kernels = kernels_for(x)
    if kernels is None:
        return torch.nn.functional.linear(x, packed.dequantize(x.dtype).to(x.device), bias)
    if float_output:
        x = x.float()
    rows = current_rows()
    if prompt_weight is None or rows.prompt is None or x.dtype != torch.bfloat16:
        return kernels.int_linear(x.contiguous(), packed.qweight, packed.scales, packed.mins, packed.bits,
                                  packed.group, packed.n, bias)
    if rows.other is None:
        return prompt_linear(kernels, x, prompt_weight, bias, packed.n)
    out = x.new_empty(x.shape[0], packed.n)
    out[rows.other] = kernels.int_linear(x[rows.other], packed.qweight, packed.scales, packed.mins, packed.bits,
                                         packed.group, packed.n, bias)
    out[rows.prompt] = prompt_linear(kernels, x[rows.prompt], prompt_weight, bias, packed.n)
    return out


def prompt_linear(kernels: ModuleType, x: torch.Tensor, prompt_weight: PromptWeight, bias: torch.Tensor | None,
                  n: int) -> torch.Tensor:
    """Prompt rows ``x`` through a layer's prompt copy: tile_linear's bfloat16 one, or the 8-bit one."""
    if isinstance(prompt_weight, PackedInt):
        return kernels.int_linear_row_scale(x.contiguous(), prompt_weight.qweight, prompt_weight.scales,
                                            prompt_weight.mins, n, bias)
    return kernels.tile_linear(x, prompt_weight, bias, n)


def prompt_weight_of(packed: PackedInt, dtype: torch.dtype) -> PromptWeight | None:
    """The copy of ``packed`` a step's prompt rows go through (see the module docstring), where the model computes
    in bfloat16 and the copy fits in memory: dequantized to bfloat16 in ``tile_linear``'s layout where the CPU has
    AMX (or ``HERON_PROMPT_WEIGHTS=1``); else in 8 bits with one scale per output row (``row_scale_copy``) where
    it has AVX-512 VNNI; else None."""
    setting = os.environ.get("HERON_PROMPT_WEIGHTS")
    kernels = cpu_kernels()
    if dtype != torch.bfloat16 or setting == "0" or kernels is None:
        return None
    if setting == "1" or kernels.tile_linear_amx():
        return tile_packed(packed.dequantize(torch.bfloat16))
    if kernels.row_scale_available() and packed.k % ACT_BLOCK == 0:
        return row_scale_copy(packed)
    return None


def row_scale_copy(packed: PackedInt) -> PackedInt | None:
    """``packed`` requantized to 8 bits with one scale and min per output row (``kernels.int_linear_row_scale``),
    where the copy fits in memory (``copy_fits``); else None. Each row spans its own range in 255 steps: for a
    4-bit block format the copy's error is a small part of the format's own."""
    if not copy_fits(torch.empty(packed.n, packed.k, dtype=torch.uint8, device="meta")):
        return None
    weight = packed.dequantize()
    low, high = weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True)
    scales = (high - low) / 255
    q = torch.round((weight - low) / torch.where(scales > 0, scales, 1.0)).clamp_(0, 255).to(torch.uint8)
    return pack(IntShard(q, scales, low, 8, packed.k))


class PackedIntLinearMethod(QuantizationMethod):
    """The base of every integer format: a subclass registers its checkpoint's tensors (``create_weights``)
    and turns a loaded layer's into one ``IntShard`` per projection (``shards``); this packs them once loaded,
    drops the checkpoint tensors and multiplies with ``linear``.
    """

    @abstractmethod
    def shards(self, layer: nn.Module) -> list[IntShard]:
        """The loaded layer's weight, one shard per entry of ``layer.output_sizes``."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Pack the layer's shards into ``layer.packed`` (and its ``prompt_weight``, where it has one) and free
        the checkpoint tensors."""
        packed = pack(merge(self.shards(layer)))
        for name in [n for n in layer._parameters if n != "bias"]:
            del layer._parameters[name]
        layer.packed = packed
        layer.prompt_weight = prompt_weight_of(packed, layer.params_dtype) if layer.step_rows else None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + bias`` from ``layer.packed`` (and its ``prompt_weight``)."""
        return linear(x, layer.packed, bias, layer.prompt_weight, layer.float_output)

    def describe(self, layer: nn.Module) -> str:
        """The kernel the packed weight goes through here."""
        if isinstance(layer.prompt_weight, PackedInt):
            return f"{integer_kernel()}, prompt tokens through an 8-bit copy with a scale per output row"
        if layer.prompt_weight is not None:
            return f"{integer_kernel()}, prompt tokens through a bfloat16 copy ({tile_kernel()})"
        return integer_kernel()

    def stack_linear(self, layer: nn.Module, kernels: ModuleType):
        """``layer.packed`` for the decoder stack's integer kernel call."""
        p = layer.packed
        return kernels.StackLinear.packed(p.qweight, p.scales, p.mins, p.bits, p.group, p.n, layer.bias)


def integer_kernel() -> str:
    """The kernel packed integer weights go through on this machine."""
    if cpu_kernels() is None:
        return "no CPU kernels: dequantized per matmul"
    if amx_rows := cpu_kernels().int_linear_amx_rows():
        return f"int8-dot kernel (AVX-512 VNNI; AMX tiles from {amx_rows} rows)"
    if {"avx512_vnni", "avx512bw"} <= cpu_flags():
        return "int8-dot kernel (AVX-512 VNNI)"
    if {"avx2", "fma", "f16c"} <= cpu_flags():
        return "int8-dot kernel (AVX2)"
    return "int8-dot kernel (portable C++: no AVX-512 VNNI or AVX2 here, slow)"
