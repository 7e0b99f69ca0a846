"""The seam between linear layers and weight formats (vLLM's LinearMethodBase): a quantization method registers
a layer's weight parameters, may repack them once loaded, and computes the layer's matmul from them.

A parameter with a per-output-row axis carries an ``output_dim`` attribute naming it (see ``linear_parameter``);
a merged layer's loader places checkpoint shard i in that axis' rows of projection i. A parameter without one
(a per-tensor scale) holds one slot per projection along dim 0: shape ``[len(output_sizes)]``. A per-input-column
axis is named by ``input_dim``: tensor parallelism cuts a row-parallel layer's checkpoint tensors along it (and a
column-parallel layer's along ``output_dim``) before ``load`` sees them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from heron.cpu import available_memory, has_native_bf16, total_memory
from heron.kernels import cpu_kernels, kernels_for

GEMV_MAX_ROWS = 4  # the rows heron's bfloat16 matrix-vector kernel takes (it reads W once for all of them)
ONEDNN_PACK_ROWS = 32  # the batch size oneDNN picks its packed weight layout for (a hint; any size works)


def linear_parameter(data: torch.Tensor, output_dim: int | None = None, input_dim: int | None = None
                     ) -> nn.Parameter:
    """A frozen parameter of a linear layer; ``output_dim`` / ``input_dim`` are its per-output-row and
    per-input-column axes, where it has them."""
    param = nn.Parameter(data, requires_grad=False)
    param.output_dim = output_dim
    param.input_dim = input_dim
    return param


class QuantizationMethod(ABC):
    """How a linear layer stores its weight and computes ``x W^T + b``; stateless, all state lives on the layer."""

    quantizes_lm_head = False  # the LM head stays dense unless the format says otherwise (as vLLM)
    tensor_parallel = False  # whether its parameters name their output/input axes, so a layer can be sharded

    @classmethod
    def for_layer(cls, quant_config: dict, layer: str) -> QuantizationMethod:
        """The method for linear layer ``layer`` of a model whose ``quantization_config`` is ``quant_config``."""
        if layer == "lm_head" and not cls.quantizes_lm_head:
            return UnquantizedLinearMethod()
        return cls()

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        """Register the weight parameters of ``layer``, whose output is the row blocks ``output_sizes``."""

    def load(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
        """Copy a checkpoint tensor into ``param`` (casting to its dtype): all of it, or projection ``shard_id``'s
        rows along its ``output_dim``, or that projection's slot when it has none."""
        target = param.data
        if shard_id is not None:
            output_dim = getattr(param, "output_dim", None)
            if output_dim is None:
                target = target[shard_id]
            else:
                offset = sum(layer.output_sizes[:shard_id])
                target = target.narrow(output_dim, offset, layer.output_sizes[shard_id])
        if _squeezed(target.shape) != _squeezed(loaded.shape):
            where = "parameter" if shard_id is None else f"shard {shard_id}"
            raise ValueError(f"shape mismatch: {where} {tuple(target.shape)} vs checkpoint {tuple(loaded.shape)}")
        target.copy_(loaded.reshape(target.shape))

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 (optional hook)
        """Repack the loaded parameters for ``apply`` (transpose, fuse scales...); nothing by default."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + bias`` computed from ``layer``'s parameters."""

    def describe(self, layer: nn.Module) -> str | None:
        """The path ``layer``'s matmul takes, for the start log line (None: the dense default)."""
        return None

    def stack_linear(self, layer: nn.Module, kernels: ModuleType):
        """``layer``'s matmul as a ``kernels.StackLinear`` for the one-call decoder stack
        (heron/model/decoder_stack.py), computing exactly what ``apply`` does; None where the stack cannot."""
        return None


class UnquantizedLinearMethod(QuantizationMethod):
    """A dense ``weight`` [out, in] in the model dtype, multiplied with ``F.linear``.

    On a CPU with native bfloat16, a few rows go through heron's matrix-vector kernel (it reads the weight at
    memory speed), and more rows through a copy packed once at load (``batch_packed``): heron's bfloat16 matmul
    where it runs (AMX or AVX-512 BF16), else oneDNN's blocked layout (``F.linear`` would reorder the weight on
    every call). The plain weight stays for the former. Where the matmul runs on AVX-512 BF16 vectors every row
    takes the copy (``copy_takes_every_row``).
    """

    tensor_parallel = True

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        """Register ``weight`` [sum(output_sizes), input_size]."""
        weight = torch.empty(sum(output_sizes), input_size, dtype=params_dtype)
        layer.register_parameter("weight", linear_parameter(weight, output_dim=0, input_dim=1))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Pack a bfloat16 CPU weight for many rows (``layer.batch_weight``) where ``batch_packed`` allows."""
        layer.batch_weight = batch_packed(layer.weight.detach())

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + bias`` from ``layer.weight`` (and its copy for many rows): ``dense_linear``."""
        return dense_linear(x, layer.weight, getattr(layer, "batch_weight", None), bias)

    def describe(self, layer: nn.Module) -> str | None:
        """Where the layer's copy for many rows goes (None: it has none)."""
        return describe_batch_weight(getattr(layer, "batch_weight", None))

    def stack_linear(self, layer: nn.Module, kernels: ModuleType):
        """``dense_stack_linear`` of the layer's weight."""
        return dense_stack_linear(layer.weight, getattr(layer, "batch_weight", None), layer.bias, kernels)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, batch_weight: torch.Tensor | None,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + bias`` for a dense W: heron's kernel for a few bfloat16 rows, W's copy from ``batch_packed`` (if
    any) for more, or for every row where ``copy_takes_every_row``."""
    # None: float32 rows, another device, or the kernels turned off since load (HERON_CPU_KERNELS=0)
    kernels = kernels_for(x) if x.dtype == torch.bfloat16 else None
    if copy_takes_every_row(batch_weight, kernels):
        return kernels.tile_linear(x, batch_weight, bias, weight.shape[0])
    if kernels is not None and x.shape[0] <= GEMV_MAX_ROWS and x.is_contiguous() and has_native_bf16():
        # torch's one-row bf16 kernels read the weight at about half the memory speed here
        # (docs/performance.md): a small batch's decode step is mostly these products
        return kernels.gemv_bf16(x, weight, bias)
    if batch_weight is not None and x.dtype == torch.bfloat16:
        if batch_weight.is_mkldnn:
            return onednn_linear(x, batch_weight, bias)
        if kernels is not None:
            return kernels.tile_linear(x, batch_weight, bias, weight.shape[0])
    return F.linear(x, weight, bias)


def copy_takes_every_row(batch_weight: torch.Tensor | None, kernels: ModuleType | None) -> bool:
    """Whether a dense layer sends every bfloat16 row, one or many, to its ``tile_packed`` copy: where tile_linear
    runs on AVX-512 BF16 vectors (no AMX). Each output is there one float32 sum over the inputs in order, whatever
    the rows, so a row's bits do not depend on its batch (the matrix-vector kernel sums in another order: a row
    through it and the same row among 5+ rows, or in a 5-token verification, differed in rare last bits), and
    it reads the copy as fast as the matrix-vector kernel reads the weight (Zen 4, the model's layers: 1 row 4.3
    against 5.3 ms, 4 rows 5.5 against 5.2). With AMX, a few rows still take the matrix-vector kernel."""
    return (batch_weight is not None and not batch_weight.is_mkldnn and kernels is not None
            and not kernels.tile_linear_amx())


def onednn_linear(x: torch.Tensor, onednn_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + bias`` for bfloat16 rows and W's copy from ``onednn_packed``."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), onednn_weight, bias, "none", [], "")


def dense_stack_linear(weight: torch.Tensor, batch_weight: torch.Tensor | None, bias: torch.Tensor | None,
                       kernels: ModuleType):
    """``dense_linear`` as a ``kernels.StackLinear``."""
    return kernels.StackLinear.dense(weight, batch_weight, bias,
                                     has_native_bf16() and not copy_takes_every_row(batch_weight, kernels))


def batch_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """A bfloat16 weight's copy for more rows than the matrix-vector kernel takes: ``tile_packed`` where heron's
    matmul runs (AMX tiles: 1.3-1.5x oneDNN's at 5-64 rows on Sapphire Rapids; AVX-512 BF16: 1.0-1.2x on Zen 4;
    docs/performance.md), else ``onednn_packed``; None for other dtypes, or where neither applies."""
    if weight.dtype != torch.bfloat16:
        return None
    tiles = tile_packed(weight)
    return tiles if tiles is not None else onednn_packed(weight)


def describe_batch_weight(batch_weight: torch.Tensor | None) -> str | None:
    """The path of a dense layer's rows past the matrix-vector kernel, for the start log line."""
    if batch_weight is None:
        return None
    return f"dense, above {GEMV_MAX_ROWS} rows {'oneDNN' if batch_weight.is_mkldnn else tile_kernel()}"


def tile_kernel() -> str:
    """How ``kernels.tile_linear`` multiplies here, for the start log line."""
    return "AMX tiles" if cpu_kernels().tile_linear_amx() else "AVX-512 BF16"


def _squeezed(shape: torch.Size) -> list[int]:
    """A shape without its size-1 axes: a scale stored as [] or [n] fits a parameter of [1] or [n, 1]."""
    return [d for d in shape if d != 1]


def copy_fits(weight: torch.Tensor) -> bool:
    """Whether a copy of ``weight`` leaves a quarter of the machine's memory free (a large model keeps none)."""
    return available_memory() - weight.nbytes > total_memory() // 4


def onednn_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [out, in] in oneDNN's blocked layout (``F.linear`` would reorder it on every call), for a
    bfloat16 CPU weight where oneDNN is built in and the copy fits (``copy_fits``); else None."""
    if (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and has_native_bf16()
            and torch.backends.mkldnn.is_available() and copy_fits(weight)):
        return torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_PACK_ROWS)
    return None


def tile_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [out, in] in the layout of heron's bfloat16 matmul (``kernels.tile_linear``: [out/16, in/32, 16
    input pairs, 16 outputs x 2], out padded to 32 with zeros), where it runs (AMX tiles or AVX-512 BF16), ``in``
    is a multiple of 32 and the copy fits (``copy_fits``); else None."""
    kernels = kernels_for(weight)
    n, k = weight.shape
    if kernels is None or not kernels.tile_linear_available() or k % 32 or not copy_fits(weight):
        return None
    padded = F.pad(weight.to(torch.bfloat16), (0, 0, 0, -n % 32))
    return padded.view(-1, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).reshape(-1, k // 32, 16, 32).contiguous()

