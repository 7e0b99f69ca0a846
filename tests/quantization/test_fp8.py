"""FP8 weights: the exact fp8 conversion, quantization error within e4m3's precision, layers (merged ones
included) equal to their dequantized reference, ``--quantization fp8`` end to end (batching, the server), and
vLLM-fp8 and compressed-tensors checkpoints written here by hand, whose logits equal the float model of their
dequantized weights; and the clear errors for what is not supported.

On the CPU the weight is multiplied in the activations' dtype, so in float32 the comparisons are exact to float
rounding. The fp8 x fp8 path (``torch._scaled_mm``, chosen on FP8 GPUs) runs here too, as torch has it on the
CPU, but only its arithmetic is checked: the GPU selection is not.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import heron_logits
from safetensors.torch import load_file, save_file

from heron import LLM, SamplingParams
from heron.errors import ModelLoadError
from heron.layers.linear import Linear, LinearBase, MergedLinear
from heron.model.loader import load_model
from heron.quantization.fp8 import (
    FP8,
    CompressedTensorsLinearMethod,
    Fp8LinearMethod,
    Fp8Scheme,
    fp8_to,
    has_fp8_matmul,
    quantize_rows,
)

from ..server.conftest import ServerProcess

CPU = torch.device("cpu")
SIZES = [40, 24, 24]  # a merged q/k/v-like layer
STATIC = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
DYNAMIC_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}


def meta_built(layer_fn, dtype: torch.dtype = torch.float32) -> LinearBase:
    """A layer built as the loader builds it: on meta in the model's ``dtype``, then ``to_empty``."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            layer = layer_fn()
    finally:
        torch.set_default_dtype(default)
    return layer.to_empty(device=CPU)


def by_hand(w: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` quantized as a checkpoint's writer does (round to nearest e4m3, saturate), and its dequantized value."""
    q = (w.float() / scale.float()).clamp(-448, 448).to(FP8)
    return q, q.float() * scale.float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_to_is_exact_for_every_value(dtype):
    every = torch.arange(256, dtype=torch.uint8).view(FP8)
    expected = every.to(dtype)  # torch's own conversion, element by element on the CPU
    got = fp8_to(every, dtype)
    finite = ~expected.isnan()
    assert got.dtype == dtype and torch.equal(got[finite], expected[finite])
    assert torch.equal(fp8_to(every.view(16, 16), dtype), got.view(16, 16))


def test_dynamic_quantization_is_within_e4m3_precision():
    w = torch.randn(48, 96) * torch.rand(48, 1) * 4
    w[7] = 0.0  # an all-zero row: a finite scale, zeros back
    w[9, :10] = 1e-6  # values under e4m3's smallest normal of the row
    q, scale = quantize_rows(w)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (48, 1)
    deq = q.float() * scale
    # 3 mantissa bits: half a step is |w| / 16 for normal numbers, 2**-10 of the scale below them
    assert torch.all((deq - w).abs() <= torch.maximum(w.abs() / 16, scale * 2**-10) * (1 + 1e-6))
    assert torch.equal(deq[7], torch.zeros(96))
    assert torch.equal(q.float().abs().amax(dim=1)[w.abs().amax(dim=1) > 0], torch.full((47,), 448.0))


def load_checkpoint_layer(sizes: list[int], per_channel: bool, dtype: torch.dtype, bias: bool):
    """A layer of a serialized-fp8 scheme, loaded shard by shard as the loader does; returns it and the
    dequantized weight it must compute with."""
    method = Fp8LinearMethod(Fp8Scheme(serialized=True))
    layer = meta_built(lambda: MergedLinear(96, sizes, bias=bias, quant_method=method), dtype)
    deqs = []
    for i, rows in enumerate(sizes):
        w = torch.randn(rows, 96) * (i + 1)
        scale = w.abs().amax(dim=1, keepdim=True) / 448 if per_channel else w.abs().amax() / 448  # [n, 1] or []
        q, deq = by_hand(w, scale)
        layer.weight_loader(layer.weight, q, i)
        layer.weight_loader(layer.weight_scale, scale, i)
        deqs.append(deq)
    if bias:
        torch.nn.init.normal_(layer.bias)
    return layer, torch.cat(deqs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["dynamic", "per-tensor", "per-channel"])
@pytest.mark.parametrize("sizes", [SIZES, [64]])
def test_layer_equals_its_dequantized_reference(form, sizes, dtype):
    if form == "dynamic":
        layer = meta_built(lambda: MergedLinear(96, sizes, bias=True, quant_method=Fp8LinearMethod()), dtype)
        torch.nn.init.normal_(layer.weight)
        torch.nn.init.normal_(layer.bias)
        q, scale = quantize_rows(layer.weight.detach())
        reference = q.float() * scale
    else:
        layer, reference = load_checkpoint_layer(sizes, form == "per-channel", dtype, bias=True)
    bias = layer.bias.detach().clone()
    layer.quant_method.process_weights_after_loading(layer)
    rows = sum(sizes)
    assert {n: (p.dtype, tuple(p.shape)) for n, p in layer.named_parameters()} == {
        "weight": (FP8, (rows, 96)), "weight_scale": (torch.float32, (rows,)), "bias": (dtype, (rows,))}
    assert not layer.fp8_matmul and layer.input_scale is None
    torch.testing.assert_close(layer.weight.float() * layer.weight_scale[:, None], reference, atol=0, rtol=0)
    for tokens in (1, 5, 40):  # heron's few-row kernel in bfloat16, and F.linear
        x = torch.randn(tokens, 96).to(dtype)
        expected = F.linear(x.float(), reference, bias.float())
        got = layer(x)
        assert got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
        else:  # x, the output and its scaling rounded to bfloat16
            assert (got.float() - expected).norm() / expected.norm() < 0.01


def test_a_per_tensor_scale_is_each_projections_own():
    layer, _ = load_checkpoint_layer(SIZES, per_channel=False, dtype=torch.float32, bias=False)
    slots = [layer.weight_scale[sum(SIZES[:i])].item() for i in range(3)]
    layer.quant_method.process_weights_after_loading(layer)
    assert len(set(slots)) == 3  # no requantization to one scale
    assert layer.weight_scale.tolist() == [s for s, n in zip(slots, SIZES, strict=True) for _ in range(n)]


def test_static_input_scale_is_the_largest_projections():
    scheme = Fp8Scheme(serialized=True, static_input=True)
    layer = meta_built(lambda: MergedLinear(96, SIZES, quant_method=Fp8LinearMethod(scheme)))
    for i, value in enumerate([0.5, 2.0, 1.0]):
        layer.weight_loader(layer.input_scale, torch.tensor(value), i)
    layer.weight.data.zero_()
    layer.weight_scale.data.fill_(1.0)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.input_scale.tolist() == [2.0]


@pytest.mark.parametrize("static", [False, True])
def test_fp8_by_fp8_matmul_is_within_the_activations_rounding(static):
    """The GPU path's arithmetic (per-token or static activation scales), run by torch's CPU ``_scaled_mm``."""
    assert not has_fp8_matmul(CPU)  # the CPU takes the weight-only path: it is faster there
    scheme = Fp8Scheme(serialized=True, static_input=static)
    layer = meta_built(lambda: MergedLinear(96, [48, 32], quant_method=Fp8LinearMethod(scheme)))
    w = torch.randn(80, 96)
    q, reference = by_hand(w, w.abs().amax(dim=1, keepdim=True) / 448)
    layer.weight.data.copy_(q)
    layer.weight_scale.data.copy_(w.abs().amax(dim=1, keepdim=True) / 448)
    x = torch.randn(7, 96).to(torch.bfloat16)
    if static:
        layer.input_scale.data.fill_(x.float().abs().max() / 448)
    layer.quant_method.process_weights_after_loading(layer)
    layer.fp8_matmul = True
    expected = F.linear(x.float(), reference)
    got = layer(x)
    assert got.dtype == torch.bfloat16 and (got.float() - expected).norm() / expected.norm() < 0.05


def write_fp8_checkpoint(model_dir: Path, out: Path, quantization_config: dict, per_channel: bool,
                         input_scale: bool, scale_dtype: torch.dtype) -> tuple[Path, Path]:
    """Copies of ``model_dir``: every projection quantized by hand to fp8 with float ``scale_dtype`` scales, per
    row ([out, 1]) or per tensor (a scalar for vLLM's format, [1] for compressed-tensors), the config carrying
    ``quantization_config``; and the float model of those weights dequantized. Returns both dirs."""
    quant_dir, float_dir = out / "fp8", out / "dequantized"
    quant, dequant = {}, {}
    scalar_shape = [] if quantization_config["quant_method"] == "fp8" else [1]
    for name, w in load_file(model_dir / "model.safetensors").items():
        quant[name] = dequant[name] = w
        if name.endswith("_proj.weight"):
            prefix = name.removesuffix("weight")
            amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(scalar_shape)
            scale = (amax / 448).to(scale_dtype)
            quant[name], dequant[name] = by_hand(w, scale)
            quant[prefix + "weight_scale"] = scale
            if input_scale:
                quant[prefix + "input_scale"] = torch.tensor(0.02, dtype=scale_dtype).reshape(scalar_shape)
    for path, tensors in ((quant_dir, quant), (float_dir, dequant)):
        shutil.copytree(model_dir, path)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((quant_dir / "config.json").read_text())
    (quant_dir / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return quant_dir, float_dir


def vllm_fp8(activation_scheme: str, **extra) -> dict:
    return {"quant_method": "fp8", "activation_scheme": activation_scheme, **extra}


def compressed_tensors(weights: dict, inputs: dict | None, **extra) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "quantization_status": "compressed", "kv_cache_scheme": None, **extra,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}}}


def same_prompt_logits(quant_dir: Path, float_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    prompt = torch.randint(3, 300, (29,), generator=torch.Generator().manual_seed(0)).tolist()
    return (heron_logits(LLM(str(quant_dir), block_size=8, dtype="float32"), prompt),
            heron_logits(LLM(str(float_dir), block_size=8, dtype="float32"), prompt))


CHECKPOINTS = {  # name: (quantization_config, per-channel scales, input_scale tensors)
    "vllm-fp8-dynamic": (vllm_fp8("dynamic"), False, False),
    "vllm-fp8-static": (vllm_fp8("static", ignored_layers=["lm_head"]), False, True),
    "vllm-fp8-per-channel": (vllm_fp8("dynamic"), True, False),
    "ct-channel-dynamic": (compressed_tensors({**STATIC, "strategy": "channel"}, DYNAMIC_TOKEN), True, False),
    "ct-tensor-static": (compressed_tensors(STATIC, STATIC), False, True),
    "ct-channel-weight-only": (compressed_tensors({**STATIC, "strategy": "channel"}, None), True, False),
}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # a tied LM head, and an untied one with q/k/v biases
@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
def test_fp8_checkpoint_logits_equal_the_dequantized_float_model(tiny_model_dir, tmp_path, checkpoint, arch):
    quantization_config, per_channel, input_scale = CHECKPOINTS[checkpoint]
    # compressed-tensors writes its scales in the model's dtype, vLLM's fp8 in float32
    scale_dtype = torch.bfloat16 if checkpoint.startswith("ct") else torch.float32
    quant_dir, float_dir = write_fp8_checkpoint(tiny_model_dir(arch), tmp_path, quantization_config, per_channel,
                                                input_scale, scale_dtype)
    model = load_model(str(quant_dir), torch.float32, CPU).model
    qkv = model.layers[0].self_attn.qkv_proj
    method = Fp8LinearMethod if checkpoint.startswith("vllm") else CompressedTensorsLinearMethod
    assert type(qkv.quant_method) is method
    assert qkv.weight.dtype == FP8 and qkv.weight_scale.shape == (qkv.output_size,)
    assert (qkv.input_scale is not None) == input_scale
    assert model.lm_head.weight.dtype == torch.float32
    got, expected = same_prompt_logits(quant_dir, float_dir)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


def write_dequantized_model(model_dir: Path, out: Path) -> Path:
    """A float copy of ``model_dir`` whose projections hold ``--quantization fp8``'s dequantized weights."""
    shutil.copytree(model_dir, out)
    tensors = load_file(model_dir / "model.safetensors")
    for name, w in tensors.items():
        if name.endswith("_proj.weight"):
            q, scale = quantize_rows(w)
            tensors[name] = q.float() * scale
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantization_fp8_logits_equal_the_dequantized_float_model(tiny_model_dir, tmp_path, arch, caplog):
    model_dir = tiny_model_dir(arch)
    with caplog.at_level(logging.INFO, logger="heron.engine.core"):
        quantized = LLM(str(model_dir), block_size=8, dtype="float32", quantization="fp8")
    lines = [r.getMessage() for r in caplog.records if r.name == "heron.engine.core" and "weights" in r.getMessage()]
    assert len(lines) == 1 and "8 fp8 weight-only: on the CPU a memory saving" in lines[0], lines
    assert "1 dense" in lines[0]  # the LM head
    model = quantized.engine.core.runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert all(m.weight.dtype == FP8 for m in linears if isinstance(m.quant_method, Fp8LinearMethod))
    assert len(linears) == 9 and [m for m in linears if m.weight.dtype != FP8] == [model.lm_head]
    assert model.lm_head.weight.dtype == torch.float32  # the LM head stays dense
    prompt = torch.randint(3, 300, (33,), generator=torch.Generator().manual_seed(2)).tolist()
    reference = LLM(str(write_dequantized_model(model_dir, tmp_path / "dequantized")), block_size=8,
                    dtype="float32")
    torch.testing.assert_close(heron_logits(quantized, prompt), heron_logits(reference, prompt), atol=1e-4,
                               rtol=1e-5)


def test_batched_greedy_equals_one_at_a_time(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), block_size=8, dtype="float32", quantization="fp8")
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 300, (n,), generator=g).tolist()} for n in (3, 5, 8, 6)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(batch):
        return [o.outputs[0].token_ids for o in llm.generate(batch, greedy, use_tqdm=False)]

    assert run(prompts) == [run([p])[0] for p in prompts]


def test_bfloat16_model_of_an_fp8_checkpoint_is_its_float32_one_to_bfloat16_rounding(tiny_model_dir, tmp_path):
    """The same fp8 weights computed in bfloat16 (heron's one-row kernel, oneDNN, scales on the output) differ
    by bfloat16's rounding only, as a dense model does (~1.3% here)."""
    config = compressed_tensors({**STATIC, "strategy": "channel"}, DYNAMIC_TOKEN)
    quant_dir, _ = write_fp8_checkpoint(tiny_model_dir("qwen2"), tmp_path, config, True, False, torch.bfloat16)
    prompt = list(range(3, 43))
    bf16 = heron_logits(LLM(str(quant_dir), block_size=8, dtype="bfloat16"), prompt)
    fp32 = heron_logits(LLM(str(quant_dir), block_size=8, dtype="float32"), prompt)
    assert (bf16.float() - fp32).norm() / fp32.norm() < 0.03


INT4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}


@pytest.mark.parametrize("config,flag,message", [
    (compressed_tensors(INT4, None, format="pack-quantized"), None,
     r"group 'group_0' quantizes weights as \{'num_bits': 4, 'type': 'int', 'strategy': 'group'.*; heron loads "
     "compressed-tensors checkpoints whose weights are FP8"),
    (compressed_tensors(STATIC, DYNAMIC_TOKEN, ignore=["lm_head", "model.layers.0.mlp.down_proj"]), None,
     r"ignore \['model.layers.0.mlp.down_proj'\] keeps layers other than the LM head unquantized"),
    (compressed_tensors(STATIC, STATIC, kv_cache_scheme=STATIC), None, "kv_cache_scheme"),
    (vllm_fp8("dynamic", weight_block_size=[128, 128]), None, "block-wise fp8"),
    (None, "compressed-tensors", "without config_groups describes no quantized weights .* use --quantization fp8"),
    (compressed_tensors(STATIC, None), "fp8", "quantized with 'compressed-tensors'; it cannot be loaded as 'fp8'"),
])
def test_what_is_not_supported_is_one_clear_error(tiny_model_dir, tmp_path, config, flag, message):
    model_dir = tiny_model_dir("llama")
    if config is not None:
        model_dir = shutil.copytree(model_dir, tmp_path / "model")
        (model_dir / "config.json").write_text(json.dumps(
            {**json.loads((model_dir / "config.json").read_text()), "quantization_config": config}))
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(model_dir), block_size=8, quantization=flag)


def test_a_plain_linear_gets_a_scalar_scale_on_its_rows():
    layer = meta_built(lambda: Linear(32, 16, quant_method=Fp8LinearMethod(Fp8Scheme(serialized=True))))
    layer.weight_loader(layer.weight_scale, torch.tensor(0.25))
    assert layer.weight_scale.shape == (16, 1) and torch.equal(layer.weight_scale, torch.full((16, 1), 0.25))


def test_server_answers_a_completion_with_fp8(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    with ServerProcess(model, "--quantization", "fp8", "--max-model-len", "256",
                       log_path=tmp_path / "server.log") as server:
        completion = server.client().completions.create(model=str(model), prompt="Hello", max_tokens=5,
                                                        temperature=0)
        log = server.log()
    assert completion.choices[0].finish_reason in ("length", "stop") and 1 <= completion.usage.completion_tokens <= 5
    assert log.count("fp8 weight-only: on the CPU a memory saving") == 1
