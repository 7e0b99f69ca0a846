"""Linear layers with a pluggable quantization method: shard placement of every per-row parameter, and a toy
int8 method loaded end to end through heron's real loader (dtypes kept, logits equal the dequantized model's)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import heron_logits
from safetensors.torch import load_file, save_file
from torch import nn

from heron import LLM
from heron.errors import ModelLoadError
from heron.layers.linear import Linear, LinearBase, MergedLinear
from heron.model.loader import load_model
from heron.quantization import QuantizationMethod, linear_parameter, register_quantization_method
from heron.quantization.registry import QUANTIZATION_METHODS

TOY = "toy-int8"  # registered for this module only
CPU = torch.device("cpu")


class ToyInt8Method(QuantizationMethod):
    """int8 ``weight`` [out, in] with a float32 per-output-channel ``weight_scale`` [out, 1]."""

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        rows = sum(output_sizes)
        layer.register_parameter("weight", linear_parameter(torch.empty(rows, input_size, dtype=torch.int8), 0))
        layer.register_parameter("weight_scale", linear_parameter(torch.empty(rows, 1, dtype=torch.float32), 0))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.processed = True

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight.to(x.dtype) * layer.weight_scale.to(x.dtype), bias)


@pytest.fixture(scope="module", autouse=True)
def toy_method():
    register_quantization_method(TOY, ToyInt8Method)
    yield
    del QUANTIZATION_METHODS[TOY]


def write_int8_checkpoint(model_dir: Path, out: Path, declare: bool = True) -> tuple[Path, Path]:
    """Copies of ``model_dir``: every ``*_proj.weight`` as int8 + ``weight_scale`` (config naming the toy
    method when ``declare``), and the float model with those weights dequantized. Returns both dirs."""
    quant_dir, float_dir = out / "int8", out / "dequantized"
    quant, dequant = {}, {}
    for name, w in load_file(model_dir / "model.safetensors").items():
        if name.endswith("_proj.weight"):
            scale = w.abs().amax(dim=1, keepdim=True) / 127
            q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
            quant[name], quant[name.removesuffix("weight") + "weight_scale"] = q, scale
            dequant[name] = q.float() * scale
        else:
            quant[name] = dequant[name] = w
    for path, tensors in ((quant_dir, quant), (float_dir, dequant)):
        shutil.copytree(model_dir, path)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    if declare:
        config = json.loads((quant_dir / "config.json").read_text())
        config["quantization_config"] = {"quant_method": TOY}
        (quant_dir / "config.json").write_text(json.dumps(config))
    return quant_dir, float_dir


def meta_built(layer_fn) -> LinearBase:
    """Build a layer the way the loader does: on meta, then ``to_empty`` (which replaces Parameter objects)."""
    with torch.device("meta"):
        layer = layer_fn()
    return layer.to_empty(device=CPU)


def test_merged_linear_places_each_shard_in_its_rows():
    sizes = [4, 2, 2]
    layer = meta_built(lambda: MergedLinear(8, sizes, bias=True, quant_method=ToyInt8Method()))
    for i, size in enumerate(sizes):
        layer.weight_loader(layer.weight, torch.full((size, 8), i + 1, dtype=torch.int8), i)
        layer.weight_loader(layer.weight_scale, torch.full((size, 1), i + 1.5), i)
        layer.weight_loader(layer.bias, torch.full((size,), -(i + 1.0)), i)
    rows = torch.tensor([1, 1, 1, 1, 2, 2, 3, 3])
    assert layer.weight.dtype == torch.int8 and torch.equal(layer.weight, rows[:, None].expand(8, 8).to(torch.int8))
    assert layer.weight_scale.dtype == torch.float32 and torch.equal(layer.weight_scale[:, 0], rows + 0.5)
    assert torch.equal(layer.bias, -rows.float())


def test_merged_linear_gives_a_per_tensor_scale_one_slot_per_shard():
    layer = meta_built(lambda: MergedLinear(8, [4, 2, 2]))
    layer.input_scale = linear_parameter(torch.zeros(3))
    for i in range(3):
        layer.weight_loader(layer.input_scale, torch.tensor(i + 1.0), i)
    assert layer.input_scale.tolist() == [1.0, 2.0, 3.0]


def test_linear_loads_a_scalar_into_a_one_element_scale_and_refuses_wrong_shapes():
    layer = meta_built(lambda: Linear(8, 4))
    scale = linear_parameter(torch.zeros(1))
    layer.weight_loader(scale, torch.tensor(5.0))
    assert scale.tolist() == [5.0]
    with pytest.raises(ValueError, match=r"parameter \(4, 8\) vs checkpoint \(8, 4\)"):
        layer.weight_loader(layer.weight, torch.zeros(8, 4))
    merged = meta_built(lambda: MergedLinear(8, [4, 2]))
    with pytest.raises(ValueError, match=r"shard 1 \(2, 8\) vs checkpoint \(3, 8\)"):
        merged.weight_loader(merged.weight, torch.zeros(3, 8), 1)


def test_int8_weights_and_float32_scales_keep_their_dtypes(tiny_model_dir, tmp_path):
    quant_dir, _ = write_int8_checkpoint(tiny_model_dir("qwen2"), tmp_path, declare=False)
    model = load_model(str(quant_dir), torch.bfloat16, CPU, quantization=TOY).model
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant_method, ToyInt8Method)
    assert qkv.weight.dtype == torch.int8 and qkv.weight_scale.dtype == torch.float32
    assert qkv.bias.dtype == model.embed_tokens.weight.dtype == torch.bfloat16
    stored = load_file(quant_dir / "model.safetensors")
    k_scale = stored["model.layers.0.self_attn.k_proj.weight_scale"]
    q_rows = stored["model.layers.0.self_attn.q_proj.weight"].shape[0]
    assert torch.equal(qkv.weight_scale[q_rows:q_rows + k_scale.shape[0]], k_scale)
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert all(getattr(m, "processed", False) for m in linears if isinstance(m.quant_method, ToyInt8Method))
    assert model.lm_head.weight.dtype == torch.bfloat16  # the LM head stays unquantized


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_model_logits_equal_the_dequantized_float_model(tiny_model_dir, tmp_path, arch):
    quant_dir, float_dir = write_int8_checkpoint(tiny_model_dir(arch), tmp_path)
    prompt = torch.randint(3, 300, (29,), generator=torch.Generator().manual_seed(0)).tolist()
    got = heron_logits(LLM(str(quant_dir), block_size=8, dtype="float32"), prompt)
    expected = heron_logits(LLM(str(float_dir), block_size=8, dtype="float32"), prompt)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_quantization_that_contradicts_the_checkpoint_or_is_unknown_is_refused(tiny_model_dir, tmp_path):
    quant_dir, float_dir = write_int8_checkpoint(tiny_model_dir("llama"), tmp_path)
    with pytest.raises(ModelLoadError, match="quantized with 'toy-int8'"):
        load_model(str(quant_dir), torch.float32, CPU, quantization="none")
    with pytest.raises(ModelLoadError, match="'int3' is not supported; supported: none"):
        load_model(str(float_dir), torch.float32, CPU, quantization="int3")


@pytest.mark.parametrize("extra", ["model.layers.0.self_attn.q_proj.weight_scale", "model.layers.1.mlp.odd.weight"])
def test_unknown_tensor_is_a_load_error_naming_it(tiny_model_dir, tmp_path, extra):
    model_dir = shutil.copytree(tiny_model_dir("llama"), tmp_path / "odd")
    tensors = load_file(model_dir / "model.safetensors")
    save_file({**tensors, extra: torch.ones(4)}, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=f"unexpected tensor {extra} in checkpoint"):
        load_model(str(model_dir), torch.float32, CPU)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 4, 5])
def test_few_bfloat16_rows_take_the_matrix_vector_kernel_with_the_same_result(rows, bias, monkeypatch):
    from heron.cpu import has_native_bf16
    from heron.kernels import cpu_kernels
    from heron.layers.linear import Linear
    from heron.quantization.base import GEMV_MAX_ROWS

    kernels = cpu_kernels()
    if kernels is None or not has_native_bf16():
        pytest.skip("needs heron's CPU kernels and native bfloat16")
    layer = Linear(100, 77, bias=bias)  # sizes that are not multiples of the kernel's tiles
    torch.nn.init.normal_(layer.weight)
    if bias:
        torch.nn.init.normal_(layer.bias)
    layer = layer.to(torch.bfloat16)
    x = torch.randn(rows, 100, dtype=torch.bfloat16)
    calls = []
    real = kernels.gemv_bf16
    monkeypatch.setattr(kernels, "gemv_bf16", lambda *a: calls.append(1) or real(*a))
    got = layer(x)
    expected = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float() if bias else None)
    assert calls == ([1] if rows <= GEMV_MAX_ROWS else [])
    torch.testing.assert_close(got.float(), expected, atol=0.1, rtol=0.02)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features", [100, 128], ids=["k100-onednn", "k128-tiles"])
def test_bfloat16_weight_packed_for_many_rows_gives_the_same_products(bias, in_features):
    from heron.cpu import has_native_bf16
    from heron.kernels import cpu_kernels
    from heron.layers.linear import Linear

    if not (has_native_bf16() and torch.backends.mkldnn.is_available()):
        pytest.skip("needs oneDNN and native bfloat16")
    layer = Linear(in_features, 77, bias=bias)
    torch.nn.init.normal_(layer.weight)
    if bias:
        torch.nn.init.normal_(layer.bias)
    layer = layer.to(torch.bfloat16)
    layer.quant_method.process_weights_after_loading(layer)
    kernels = cpu_kernels()
    # heron's bfloat16 matmul takes inputs in multiples of 32 columns; oneDNN's blocked layout takes the rest
    tiles = in_features % 32 == 0 and kernels is not None and kernels.tile_linear_available()
    assert layer.batch_weight.is_mkldnn != tiles
    for rows in (5, 32, 130):
        x = torch.randn(rows, in_features, dtype=torch.bfloat16)
        expected = torch.nn.functional.linear(x.float(), layer.weight.float(),
                                              layer.bias.float() if bias else None)
        torch.testing.assert_close(layer(x).float(), expected, atol=0.1, rtol=0.02)


def test_no_second_copy_for_many_rows_when_it_would_leave_under_a_quarter_of_memory_free(monkeypatch):
    import heron.quantization.base as base
    from heron.layers.linear import Linear

    layer = Linear(100, 77).to(torch.bfloat16)
    torch.nn.init.normal_(layer.weight)  # Linear leaves it uninitialized (torch.empty): it could hold NaNs
    monkeypatch.setattr(base, "total_memory", lambda: 64 << 30)
    monkeypatch.setattr(base, "available_memory", lambda: 16 << 30)  # exactly a quarter free already
    layer.quant_method.process_weights_after_loading(layer)
    assert getattr(layer, "batch_weight", None) is None
    x = torch.randn(9, 100, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight))  # F.linear then


def test_without_amx_every_bfloat16_row_of_a_dense_layer_gets_the_same_bits_in_any_batch():
    """Where tile_linear runs on AVX-512 BF16 vectors, one row, a few rows (a decode batch, a 5-token
    verification) and many rows all take the tile copy, so a row's result never depends on its batch."""
    from heron.kernels import cpu_kernels
    from heron.layers.linear import Linear
    from heron.quantization.base import copy_takes_every_row

    kernels = cpu_kernels()
    if kernels is None or not kernels.tile_linear_available() or kernels.tile_linear_amx():
        pytest.skip("needs tile_linear's AVX-512 BF16 loop (with AMX a few rows take the matrix-vector kernel)")
    for in_features, out_features in [(576, 3072), (1536, 576), (128, 77)]:
        layer = Linear(in_features, out_features, bias=True)
        torch.nn.init.normal_(layer.weight)
        torch.nn.init.normal_(layer.bias)
        layer = layer.to(torch.bfloat16)
        layer.quant_method.process_weights_after_loading(layer)
        assert copy_takes_every_row(layer.batch_weight, kernels)
        x = torch.randn(40, in_features, dtype=torch.bfloat16)
        together = layer(x)
        for size in (1, 2, 3, 4, 5, 13):  # the matrix-vector kernel's sizes, and the copy's
            for start in range(0, 40 - size + 1, size):
                rows = slice(start, start + size)
                assert torch.equal(layer(x[rows]), together[rows]), (in_features, rows)
