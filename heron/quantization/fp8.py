"""FP8 weights: ``--quantization fp8`` on a full-precision checkpoint, and FP8 checkpoints loaded as they are.

A weight is ``w[n, k] = scale[n] * q[n, k]``, q float8_e4m3fn [out, in] and one float32 scale per output row:

- **Quantized at load** (``--quantization fp8``, vLLM's dynamic fp8): the dense weight loads in the model's dtype
  and is quantized once loaded, each row's largest |w| mapped to 448 (e4m3's largest value); the dense copy is
  freed. The LM head stays dense, as in vLLM.
- **vLLM's fp8 checkpoints** (``quant_method: "fp8"`` with an ``activation_scheme``): ``weight`` fp8,
  ``weight_scale`` one float32 per tensor, and with ``"static"`` activations ``input_scale`` one per tensor.
- **compressed-tensors FP8** (llm-compressor's format; ``config_groups`` whose weights have ``num_bits: 8,
  type: "float"``): ``weight``, ``weight_scale`` per tensor (strategy "tensor": a scalar) or per row ("channel":
  [out, 1]), ``input_scale`` per tensor where the input activations are static.

A checkpoint's per-tensor scale is spread over its projection's rows as it loads, so that every form lands in
one per-row ``weight_scale``: a merged layer (q/k/v, gate/up) keeps each projection's own scale exactly, with no
requantization to one scale (vLLM's ``requantize_with_max_scale``). ``input_scale`` holds one slot per
projection (base.py's convention) and the layer multiplies with their largest, as vLLM.

The matmul: where the GPU has FP8 tensor cores (CUDA, compute capability 8.9+) ``torch._scaled_mm`` multiplies
the fp8 weight by the activations quantized to fp8 (one scale per token, or the checkpoint's static one) with
the per-row weight scales, as vLLM. Elsewhere it is weight-only: the weight is converted to the activations'
dtype for each call and the dense matmul's output scaled per row (exact, the scale being constant along each
sum). On the CPU FP8 is a memory saving only: see ``CPU_MATMUL`` and docs/quantization.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from heron.errors import ModelLoadError
from heron.quantization.base import (
    QuantizationMethod,
    UnquantizedLinearMethod,
    dense_linear,
    linear_parameter,
)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_SCALE = 1e-12  # an all-zero row (or token) keeps a finite scale
# measured with each candidate path in one run on the project's CPU (docs/quantization.md, "FP8 weights")
CPU_MATMUL = "matmul ~7-10x slower than bfloat16 for one row, ~3-7x for 32, measured on the default model's shapes"

# e4m3's bits moved into a float with an 8-bit exponent (bfloat16, float32: bias 127 against e4m3's 7) read as
# the value times 2**-120, and into float16 (bias 15) as the value times 2**-8; the multiply that undoes it
# also makes e4m3's subnormals normal numbers. (dtype: (integer of its width, shift to its exponent, factor))
_BIT_LAYOUTS = {torch.bfloat16: (torch.int16, 4, 2.0**120), torch.float16: (torch.int16, 7, 2.0**8),
                torch.float32: (torch.int32, 20, 2.0**120)}


def fp8_to(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float8_e4m3fn ``q`` in ``dtype``, exactly.

    On the CPU by moving bits (four vectorized passes): torch's own conversion is element by element there,
    12x slower (docs/quantization.md). e4m3's NaN, which no quantizer writes, reads as +-480.
    """
    if q.device.type != "cpu" or dtype not in _BIT_LAYOUTS:
        return q.to(dtype)
    int_dtype, shift, factor = _BIT_LAYOUTS[dtype]
    bits = q.view(torch.int8).to(int_dtype)  # sign-extended: the shift puts the sign in the top bit
    sign_and_magnitude = (-1 << (int_dtype.itemsize * 8 - 1)) | (0x7F << shift)
    return bits.bitwise_left_shift_(shift).bitwise_and_(sign_and_magnitude).view(dtype).mul_(factor)


def to_fp8(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``t / scale`` rounded to float8_e4m3fn, saturating at +-448."""
    return (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` [rows, cols] as float8_e4m3fn and one float32 scale per row [rows, 1], each row's largest |t|
    mapped to 448."""
    scale = (t.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)
    return to_fp8(t, scale), scale


@functools.cache
def has_fp8_matmul(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` multiplies fp8 matrices with per-row scales on ``device``: a CUDA GPU of
    compute capability 8.9+ (Ada, Hopper and later), tried once on a tiny product, as torch builds differ in
    the GPUs they give row-wise scales. (torch's CPU ``_scaled_mm`` is slower than the weight-only path.)"""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return False
    ones = torch.ones(16, 16, device=device).to(FP8)
    try:
        torch._scaled_mm(ones, ones.t(), scale_a=torch.ones(16, 1, device=device),
                         scale_b=torch.ones(1, 16, device=device), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's fp8 layers are stored."""

    serialized: bool = False  # the checkpoint holds fp8 weights and scales (else: quantized at load)
    static_input: bool = False  # the checkpoint holds ``input_scale`` (static activation scales)


class Fp8LinearMethod(QuantizationMethod):
    """``--quantization fp8`` (quantized at load) and vLLM's fp8 checkpoints; see the module docstring."""

    tensor_parallel = True

    def __init__(self, scheme: Fp8Scheme | None = None) -> None:
        self.scheme = scheme or Fp8Scheme()

    @classmethod
    def for_layer(cls, quant_config: dict, layer: str) -> QuantizationMethod:
        """The dense method for the LM head; else this method with the scheme of ``quant_config``."""
        if layer == "lm_head":
            return UnquantizedLinearMethod()
        return cls(cls.scheme_of(quant_config))

    @classmethod
    def scheme_of(cls, quant_config: dict) -> Fp8Scheme:
        """vLLM's fp8 ``quantization_config``: quantized at load without an ``activation_scheme`` (what
        ``--quantization fp8`` on a float checkpoint gives), else a checkpoint of fp8 weights with per-tensor
        scales (vLLM writes those; per-row ones load too)."""
        activation_scheme = quant_config.get("activation_scheme")
        if activation_scheme is None:
            return Fp8Scheme()
        if activation_scheme not in ("dynamic", "static"):
            raise ModelLoadError(f"fp8 activation_scheme {activation_scheme!r} is not one of dynamic, static")
        if quant_config.get("weight_block_size"):
            raise ModelLoadError(f"block-wise fp8 (weight_block_size {quant_config['weight_block_size']}) is not "
                                 "supported; heron loads fp8 checkpoints with per-tensor or per-channel scales")
        _check_only_lm_head_skipped("ignored_layers", quant_config.get("ignored_layers"))
        return Fp8Scheme(serialized=True, static_input=activation_scheme == "static")

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        """Register ``weight`` [out, in] (fp8 from a checkpoint, else dense until quantized), and from a
        checkpoint ``weight_scale`` [out, 1] and ``input_scale`` (one per projection) in float32."""
        rows, scheme = sum(output_sizes), self.scheme
        weight = torch.empty(rows, input_size, dtype=FP8 if scheme.serialized else params_dtype)
        layer.register_parameter("weight", linear_parameter(weight, output_dim=0, input_dim=1))
        if scheme.serialized:
            scale = torch.empty(rows, 1, dtype=torch.float32)
            layer.register_parameter("weight_scale", linear_parameter(scale, output_dim=0))
        if scheme.static_input:
            input_scale = torch.empty(len(output_sizes), dtype=torch.float32)
            layer.register_parameter("input_scale", linear_parameter(input_scale))
        layer.fp8_matmul = params_dtype == torch.bfloat16  # row-wise scaled products give bfloat16 out

    def load(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
        """As any method, but a per-tensor ``weight_scale`` (one element) fills its projection's rows, so that
        per-tensor and per-channel checkpoints land in the same per-row parameter."""
        if param is getattr(layer, "weight_scale", None) and loaded.numel() == 1:
            rows = layer.output_size if shard_id is None else layer.output_sizes[shard_id]
            loaded = loaded.reshape(1, 1).expand(rows, 1)
        super().load(layer, param, loaded, shard_id)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Quantize a dense weight (freeing it), flatten the scales to ``weight_scale`` [out] float32 and
        ``input_scale`` (one, or None), and choose the matmul: ``layer.fp8_matmul`` on an FP8 GPU, for
        ``torch._scaled_mm``'s shapes (multiples of 16) and a bfloat16 model."""
        if self.scheme.serialized:
            weight, scale = layer.weight.data, layer.weight_scale.data
        else:
            weight, scale = quantize_rows(layer.weight.data)
        layer.weight = linear_parameter(weight, output_dim=0)
        layer.weight_scale = linear_parameter(scale.float().view(-1), output_dim=0)
        input_scale = getattr(layer, "input_scale", None)
        # the largest of a merged layer's projections: none of their inputs is clipped (vLLM's choice)
        layer.input_scale = None if input_scale is None else linear_parameter(input_scale.data.max().view(1))
        rows, inputs = weight.shape
        layer.fp8_matmul = (layer.fp8_matmul and has_fp8_matmul(weight.device) and rows % 16 == 0
                            and inputs % 16 == 0)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + bias``: fp8 by fp8 where the layer takes ``torch._scaled_mm``; else the weight converted to
        x's dtype, the dense matmul (heron's kernel for a few rows) and the scales applied to its output
        (cheaper than scaling the weight, and exact)."""
        if layer.fp8_matmul:
            y = _scaled_mm(x, layer)
        else:
            y = dense_linear(x, fp8_to(layer.weight, x.dtype), None, None)
            # a float32 scale on a bfloat16 output takes torch's slow mixed-dtype path on the CPU (3x the
            # matmul at 1,024 rows); bfloat16 keeps float32's range, and rounds the scale as it rounds y
            scale = layer.weight_scale
            y.mul_(scale.to(torch.bfloat16) if y.dtype == torch.bfloat16 else scale)
        return y if bias is None else y + bias

    def describe(self, layer: nn.Module) -> str:
        """fp8 by fp8 (``torch._scaled_mm``), or weight-only: on the CPU a memory saving, slower than bf16."""
        if layer.fp8_matmul:
            return "fp8 matmul (torch._scaled_mm)"
        if layer.weight.device.type == "cpu":
            return f"fp8 weight-only: on the CPU a memory saving ({CPU_MATMUL})"
        return "fp8 weight-only (converted per matmul: this GPU has no fp8 matmul)"


class CompressedTensorsLinearMethod(Fp8LinearMethod):
    """compressed-tensors checkpoints (llm-compressor's format) whose weights are FP8; other compressed-tensors
    schemes are refused, naming what is supported."""

    SUPPORTED: ClassVar[str] = (
        "heron loads compressed-tensors checkpoints whose weights are FP8 (num_bits 8, type float, symmetric, "
        "strategy tensor or channel) on every linear layer but the LM head, with dynamic, static per-tensor or "
        "no input activation quantization")

    @classmethod
    def scheme_of(cls, quant_config: dict) -> Fp8Scheme:
        """The one FP8 scheme of the checkpoint's ``config_groups``; a ModelLoadError for anything else."""
        groups = quant_config.get("config_groups") or {}
        if not groups:
            raise ModelLoadError("a compressed-tensors quantization_config without config_groups describes no "
                                 "quantized weights (to quantize a full-precision checkpoint, use --quantization "
                                 f"fp8); {cls.SUPPORTED}")
        if quant_config.get("kv_cache_scheme"):
            raise ModelLoadError("compressed-tensors KV-cache scales (kv_cache_scheme) are not supported (an fp8 "
                                 f"KV cache comes from --kv-cache-dtype); {cls.SUPPORTED}")
        sparsity = (quant_config.get("sparsity_config") or {}).get("format", "dense")
        if sparsity != "dense":
            raise ModelLoadError(f"sparse compressed-tensors checkpoints ({sparsity}) are not supported; "
                                 f"{cls.SUPPORTED}")
        _check_only_lm_head_skipped("ignore", quant_config.get("ignore"))
        schemes = {cls._group_scheme(name, group) for name, group in groups.items()}
        if len(schemes) > 1:
            raise ModelLoadError(f"config_groups {', '.join(groups)} quantize layers differently; {cls.SUPPORTED}")
        return schemes.pop()

    @classmethod
    def _group_scheme(cls, name: str, group: dict) -> Fp8Scheme:
        weights, inputs = group.get("weights") or {}, group.get("input_activations")
        strategy = weights.get("strategy") or "tensor"
        if not (weights.get("num_bits") == 8 and weights.get("type") == "float" and strategy in ("tensor", "channel")
                and weights.get("symmetric", True) and not weights.get("dynamic", False)):
            found = {key: weights.get(key) for key in ("num_bits", "type", "strategy", "symmetric", "dynamic")}
            raise ModelLoadError(f"compressed-tensors group {name!r} quantizes weights as {found}; {cls.SUPPORTED}")
        if "Linear" not in (group.get("targets") or []):
            raise ModelLoadError(f"compressed-tensors group {name!r} targets {group.get('targets')}, not every "
                                 f"linear layer ('Linear'); {cls.SUPPORTED}")
        static = bool(inputs) and not inputs.get("dynamic", False)
        if static and (inputs.get("strategy") or "tensor") != "tensor":
            raise ModelLoadError(f"compressed-tensors group {name!r} has static input scales per "
                                 f"{inputs.get('strategy')}; {cls.SUPPORTED}")
        return Fp8Scheme(serialized=True, static_input=static)


def _check_only_lm_head_skipped(key: str, skipped: list[str] | None) -> None:
    """Refuse a checkpoint that keeps layers other than the LM head dense (heron's layers are named by kind,
    e.g. "qkv_proj", not by position, so one cannot stay dense while its siblings in other blocks are not)."""
    others = [entry for entry in skipped or [] if not entry.endswith("lm_head")]
    if others:
        raise ModelLoadError(f"{key} {others} keeps layers other than the LM head unquantized; heron quantizes "
                             "every linear layer but the LM head alike")


def _scaled_mm(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """``x W^T`` on fp8 tensor cores: x quantized per token (or with the static ``input_scale``), per-row scales
    on both sides, bfloat16 out."""
    if layer.input_scale is None:
        xq, x_scale = quantize_rows(x)
    else:
        x_scale = layer.input_scale.expand(x.shape[0], 1).contiguous()
        xq = to_fp8(x, x_scale)
    return torch._scaled_mm(xq, layer.weight.t(), scale_a=x_scale, scale_b=layer.weight_scale.view(1, -1),
                            out_dtype=x.dtype)
