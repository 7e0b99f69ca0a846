"""AWQ and GPTQ checkpoints, loaded exactly into heron's packed integer layout (packed_int.py).

Both store group-wise unsigned integers with a zero point, ``w[n, k] = s[g, n] * (q[k, n] - z[g, n])`` for the
group ``g`` of input ``k``, in int32 words of 32 / bits values each, as their quantizers write them (AutoAWQ's
``WQLinear_GEMM.from_linear``, auto-gptq's / GPTQModel's ``QuantLinear.pack``) and vLLM reads them:

- **AWQ** (GEMM version, 4 bits): ``qweight`` [in, out/8] packed along the output, nibble ``i`` of a word
  holding column ``AWQ_ORDER[i]`` of its 8; ``qzeros`` [in/group, out/8] likewise; ``scales`` [in/group, out].
- **GPTQ** (4 or 8 bits): ``qweight`` [in*bits/32, out] packed along the input, low bits first; ``qzeros``
  [in/group, out*bits/32] packed along the output, low bits first; ``scales`` [in/group, out]; ``g_idx`` [in],
  each input's group. v1 checkpoints (any ``checkpoint_format`` but "gptq_v2") store ``z - 1``; a symmetric
  one (``sym``, the default) has ``z = 2**(bits-1)``, which vLLM's CPU and Marlin kernels use without reading
  ``qzeros``, and so does heron.

In heron's form that is ``scales = s`` and ``mins = -s * z`` per group, exact in float32: a float16 (or
bfloat16) scale times an integer of at most 9 bits. An act-order GPTQ layer (``desc_act``: inputs quantized
in another order, so a group's inputs are scattered) has its input columns sorted by group once at load and
its activations permuted the same way at each call. Layers the checkpoint leaves dense (the LM head unless
``lm_head``, and ``modules_to_not_convert``) stay unquantized.
"""

from __future__ import annotations

from abc import abstractmethod
from types import ModuleType
from typing import Any

import torch
from torch import nn

from heron.errors import ModelLoadError
from heron.quantization.base import QuantizationMethod, UnquantizedLinearMethod, linear_parameter
from heron.quantization.packed_int import IntShard, PackedIntLinearMethod, valid_group

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack: nibble i of a word holds column AWQ_ORDER[i] of its 8
_AWQ_COLUMNS = [AWQ_ORDER.index(c) for c in range(8)]  # the nibble of each column

# the checkpoint modules behind each of heron's layers, which modules_to_not_convert names
_CHECKPOINT_MODULES = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",), "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",), "lm_head": ("lm_head",),
}


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The ``32 // bits`` unsigned integers of each int32 of ``packed``, low bits first, laid side by side
    along ``dim`` (int32; ``[r, c]`` becomes ``[r * 32 // bits, c]`` for ``dim=0``, ``[r, c * 32 // bits]``
    for ``dim=1``)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    shifts = shifts.view(-1, *[1] * (packed.dim() - 1 - dim))
    return ((packed.unsqueeze(dim + 1) >> shifts) & (2**bits - 1)).flatten(dim, dim + 1)


def _config_value(quant_config: dict, keys: tuple[str, ...], default: Any = ...) -> Any:
    """The first of ``keys`` in ``quant_config`` (formats have renamed theirs), else ``default``, else an
    error naming what is missing (a checkpoint not quantized with the method given to ``--quantization``)."""
    for key in keys:
        if key in quant_config:
            return quant_config[key]
    if default is ...:
        method = quant_config.get("quant_method")
        raise ModelLoadError(f"--quantization {method} loads {method.upper()} checkpoints, and this one's "
                             f"quantization_config has no {keys[-1]!r}")
    return default


def _stays_dense(quant_config: dict, layer: str) -> bool:
    """Whether the checkpoint keeps ``layer`` unquantized: the LM head unless ``lm_head`` is set, and layers
    ``modules_to_not_convert`` names (as vLLM, an entry matches a module whose name contains it)."""
    skipped = quant_config.get("modules_to_not_convert") or []
    modules = _CHECKPOINT_MODULES.get(layer, (layer,))
    dense = [any(entry in module for entry in skipped) for module in modules]
    if len(set(dense)) > 1:
        raise ModelLoadError(f"modules_to_not_convert {skipped} leaves only some of {', '.join(modules)} "
                             "quantized; heron computes them as one layer")
    return dense[0] or (layer == "lm_head" and not quant_config.get("lm_head", False))


def _packed_parameter(layer: nn.Module, name: str, rows: int, columns: int, packed_factor: int) -> None:
    """Register int32 ``name`` [rows, columns / packed_factor], packed along the output (dim 1)."""
    param = linear_parameter(torch.empty(rows, columns // packed_factor, dtype=torch.int32), output_dim=1)
    param.packed_factor = packed_factor
    layer.register_parameter(name, param)


def _split(shard: IntShard, sizes: list[int]) -> list[IntShard]:
    """A merged layer's shard cut into its projections' rows."""
    parts = zip(shard.q.split(sizes), shard.scales.split(sizes), shard.mins.split(sizes), strict=True)
    return [IntShard(q, scales, mins, shard.bits, shard.group) for q, scales, mins in parts]


def _int_shard(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int, group: int) -> IntShard:
    """heron's shard [out, in] from a checkpoint's ``q`` [in, out], ``zeros`` and ``scales`` [in/group, out]."""
    scales = scales.float().t().contiguous()
    return IntShard(q.t().to(torch.uint8).contiguous(), scales, -scales * zeros.float().t(), bits, group)


class _GroupwiseCheckpointMethod(PackedIntLinearMethod):
    """What AWQ and GPTQ share: the group size, dense layers, and float32 ``scales`` [in/group, out] (the
    checkpoint's float16 ones exactly, whatever the model's dtype)."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size  # -1: one group per row

    @classmethod
    def for_layer(cls, quant_config: dict, layer: str) -> QuantizationMethod:
        """The format's method, or the unquantized one for a layer the checkpoint keeps dense."""
        if _stays_dense(quant_config, layer):
            return UnquantizedLinearMethod()
        return cls.from_config(quant_config)

    @classmethod
    @abstractmethod
    def from_config(cls, quant_config: dict) -> _GroupwiseCheckpointMethod:
        """The method a checkpoint's ``quantization_config`` describes (a ModelLoadError for what heron cannot
        load)."""

    def group(self, input_size: int) -> int:
        """The group of a layer with ``input_size`` inputs; a ModelLoadError where the kernel cannot take it."""
        group = input_size if self.group_size == -1 else self.group_size
        if input_size % group or not valid_group(group):
            raise ModelLoadError(f"group size {group} does not fit a layer of {input_size} inputs (heron takes "
                                 "groups of 16, 32 or a multiple of 32 dividing them)")
        return group

    def load(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
        """The base class's loading, with a projection's shard of a tensor packed along the output placed in
        its words: such a tensor holds ``packed_factor`` output columns per element."""
        factor = getattr(param, "packed_factor", None)
        if factor is not None and shard_id is not None:
            offset, size = sum(layer.output_sizes[:shard_id]), layer.output_sizes[shard_id]
            param, shard_id = param.data.narrow(param.output_dim, offset // factor, size // factor), None
        super().load(layer, param, loaded, shard_id)

    def register_scales(self, layer: nn.Module, input_size: int, output_sizes: list[int], per_word: int) -> int:
        """Register ``scales`` and check that the projections fill whole words of ``per_word`` values; returns
        the layer's group size."""
        group = self.group(input_size)
        if any(size % per_word for size in output_sizes):
            raise ModelLoadError(f"output sizes {output_sizes} are not multiples of {per_word}, as the packed "
                                 "checkpoint's words need")
        scales = torch.empty(input_size // group, sum(output_sizes), dtype=torch.float32)
        layer.register_parameter("scales", linear_parameter(scales, output_dim=1))
        return group


class AWQLinearMethod(_GroupwiseCheckpointMethod):
    """AWQ's GEMM checkpoints: 4-bit ``qweight``/``qzeros`` packed along the output in ``AWQ_ORDER``."""

    @classmethod
    def from_config(cls, quant_config: dict) -> AWQLinearMethod:
        bits = _config_value(quant_config, ("w_bit", "bits"))
        version = str(quant_config.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or not _config_value(quant_config, ("zero_point",), True):
            raise ModelLoadError(f"heron loads AWQ's 4-bit GEMM checkpoints with zero points, not bits={bits}, "
                                 f"version={version!r}, zero_point={quant_config.get('zero_point')}")
        return cls(_config_value(quant_config, ("q_group_size", "group_size")))

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        """Register ``qweight`` [in, out/8], ``qzeros`` [in/group, out/8] and ``scales`` [in/group, out]."""
        group = self.register_scales(layer, input_size, output_sizes, 8)
        _packed_parameter(layer, "qweight", input_size, sum(output_sizes), 8)
        _packed_parameter(layer, "qzeros", input_size // group, sum(output_sizes), 8)

    def shards(self, layer: nn.Module) -> list[IntShard]:
        """Unpack the nibbles and put each word's 8 columns back in order."""
        q, zeros = (self._columns(unpack_int32(t, 4, dim=1)) for t in (layer.qweight, layer.qzeros))
        shard = _int_shard(q, zeros, layer.scales, 4, self.group(layer.input_size))
        return _split(shard, layer.output_sizes)

    @staticmethod
    def _columns(nibbles: torch.Tensor) -> torch.Tensor:
        rows = nibbles.shape[0]
        return nibbles.view(rows, -1, 8)[:, :, _AWQ_COLUMNS].reshape(rows, -1)


class GPTQLinearMethod(_GroupwiseCheckpointMethod):
    """GPTQ checkpoints (auto-gptq, GPTQModel): ``qweight`` packed along the input, ``qzeros`` along the
    output, ``g_idx`` per input; v1 or v2 zero points, symmetric or not, act-order or not."""

    def __init__(self, bits: int, group_size: int, sym: bool, v2: bool) -> None:
        super().__init__(group_size)
        self.bits = bits
        self.sym = sym
        self.v2 = v2  # zero points stored as they are (v1: minus one)

    @classmethod
    def from_config(cls, quant_config: dict) -> GPTQLinearMethod:
        bits = _config_value(quant_config, ("bits",))
        if bits not in (4, 8):
            raise ModelLoadError(f"heron loads 4- and 8-bit GPTQ checkpoints, not {bits}-bit ones")
        if quant_config.get("dynamic"):
            raise ModelLoadError("GPTQModel's per-module overrides (`dynamic`) are not supported")
        return cls(bits, _config_value(quant_config, ("group_size",)), bool(quant_config.get("sym", True)),
                   quant_config.get("checkpoint_format") == "gptq_v2")

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        """Register ``qweight`` [in*bits/32, out], ``qzeros`` [in/group, out*bits/32], ``scales``
        [in/group, out] and ``g_idx`` (one row [in] per projection: each has its own in the checkpoint)."""
        per_word = 32 // self.bits
        group = self.register_scales(layer, input_size, output_sizes, per_word)
        qweight = torch.empty(input_size // per_word, sum(output_sizes), dtype=torch.int32)
        layer.register_parameter("qweight", linear_parameter(qweight, output_dim=1))
        _packed_parameter(layer, "qzeros", input_size // group, sum(output_sizes), per_word)
        g_idx = torch.empty(len(output_sizes), input_size, dtype=torch.int32)
        layer.register_parameter("g_idx", linear_parameter(g_idx))

    def shards(self, layer: nn.Module) -> list[IntShard]:
        """Unpack ``qweight`` along the input and the zero points along the output; an act-order layer's input
        columns sorted by group (``input_order``)."""
        q = unpack_int32(layer.qweight, self.bits, dim=0)
        if self.sym:
            zeros = torch.full_like(layer.scales, 2 ** (self.bits - 1))
        else:
            zeros = unpack_int32(layer.qzeros, self.bits, dim=1) + (0 if self.v2 else 1)
        order = self.input_order(layer)
        if order is not None:
            q = q[order]
        shard = _int_shard(q, zeros, layer.scales, self.bits, self.group(layer.input_size))
        return _split(shard, layer.output_sizes)

    def input_order(self, layer: nn.Module) -> torch.Tensor | None:
        """The permutation that makes each group's inputs contiguous (None: they already are)."""
        g_idx = layer.g_idx
        if any(not torch.equal(g, g_idx[0]) for g in g_idx[1:]):
            raise ModelLoadError("the projections of a merged layer (q/k/v or gate/up) have different "
                                 "act-order g_idx; heron multiplies them as one layer with one input order")
        group = self.group(layer.input_size)
        sequential = torch.arange(layer.input_size, dtype=g_idx.dtype, device=g_idx.device) // group
        if torch.equal(g_idx[0], sequential):
            return None
        order = torch.argsort(g_idx[0], stable=True)
        if not torch.equal(g_idx[0][order], sequential):
            raise ModelLoadError(f"g_idx does not give every group {group} inputs, as GPTQ's act-order does")
        return order

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Pack the layer (the base class) and keep the input order an act-order layer needs at each call."""
        order = self.input_order(layer)  # before the base class drops g_idx
        super().process_weights_after_loading(layer)
        layer.input_order = order

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + bias``, x's inputs first put in the packed weight's order."""
        if layer.input_order is not None:
            x = x.index_select(-1, layer.input_order)
        return super().apply(layer, x, bias)

    def stack_linear(self, layer: nn.Module, kernels: ModuleType):
        """The packed weight; None for an act-order layer (the stack does not reorder inputs)."""
        return None if layer.input_order is not None else super().stack_linear(layer, kernels)
