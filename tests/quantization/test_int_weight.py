"""``--quantization int8`` / ``int4``: the quantizers' error bounds, layers equal to their dequantized
reference, tiny models (LM head included, tied or not) equal to the float model of the dequantized weights,
batching, the default GGUF model requantized, and the server.

Without heron's integer kernel (``HERON_CPU_KERNELS=0``) every float32 product is the dequantized weight's, so
the comparisons are exact; with it, products take int8 activations (rounded per 32 inputs), and the comparisons
allow that rounding, as they allow bfloat16's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import heron_logits
from safetensors.torch import load_file, save_file

from heron import LLM, SamplingParams
from heron.attention.cpu_paged import kernel_takes
from heron.errors import ModelLoadError
from heron.kernels import cpu_kernels
from heron.layers.linear import LinearBase, MergedLinear
from heron.quantization.int_weight import (
    Int4LinearMethod,
    Int8LinearMethod,
    int4_group,
    int8_group,
    quantize_int4,
    quantize_int8,
)

from ..server.conftest import ServerProcess

CPU = torch.device("cpu")
METHODS = {"int8": (Int8LinearMethod, quantize_int8, int8_group),
           "int4": (Int4LinearMethod, quantize_int4, int4_group)}
INT_KERNEL = getattr(cpu_kernels(), "int_linear", None) is not None
# the int8 activations' rounding (1/254 of a block's largest |x|), summed over a product, relative to its size
KERNEL_RTOL = 0.02


def assert_matches_reference(got: torch.Tensor, expected: torch.Tensor, rtol: float = KERNEL_RTOL) -> None:
    """``got`` equals ``expected`` to float32 rounding where the product was the dequantized weight's; where
    heron's kernel computed it with int8 activations, or in bfloat16, the relative error of the whole tensor is
    under ``rtol``."""
    if got.dtype == torch.float32 and not INT_KERNEL:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    else:
        error = (got.float() - expected.float()).norm() / expected.float().norm()
        assert error < rtol, f"relative error {error:.4f}"


def meta_built(layer_fn) -> LinearBase:
    """A layer built as the loader builds it: on meta, then ``to_empty``."""
    with torch.device("meta"):
        layer = layer_fn()
    return layer.to_empty(device=CPU)


@pytest.mark.parametrize("input_size,group", [(4096, 128), (192, 64), (96, 32), (64, 64)])
def test_int8_takes_the_largest_group_dividing_the_inputs(input_size, group):
    assert int8_group(input_size) == group


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_inputs_no_group_divides_are_refused_before_loading(method):
    with pytest.raises(ModelLoadError, match=f"{method} quantizes groups of"):
        METHODS[method][0]().create_weights(torch.nn.Module(), 100, [8], torch.float32)


@pytest.mark.parametrize("input_size", [64, 96, 256])
def test_int8_error_is_within_half_a_step_of_each_group(input_size):
    group = int8_group(input_size)
    w = torch.randn(40, input_size) * torch.rand(40, 1) * 3
    w[3, :group] = 0.0  # a group of zeros: scale 0, dequantized exactly
    shard = quantize_int8(w, group)
    assert shard.bits == 8 and shard.q.dtype == torch.uint8 and int(shard.q.min()) >= 1
    step = shard.scales.repeat_interleave(group, dim=1)
    assert torch.all((shard.dequantize() - w).abs() <= step / 2 + 1e-6 * w.abs())
    assert torch.equal(shard.dequantize()[3, :group], torch.zeros(group))
    # the largest |w| of a group is +-127 steps, exactly representable
    torch.testing.assert_close(shard.scales, w.view(40, -1, group).abs().amax(-1) / 127)


def test_int4_error_is_within_half_a_step_and_keeps_each_groups_range():
    w = torch.randn(24, 96) + torch.linspace(-2, 2, 24)[:, None]
    w[5, 32:64] = 0.75  # a constant group: scale 0, dequantized exactly
    shard = quantize_int4(w)
    assert shard.bits == 4 and shard.group == 32 and int(shard.q.max()) == 15
    step = shard.scales.repeat_interleave(32, dim=1)
    deq = shard.dequantize()
    assert torch.all((deq - w).abs() <= step / 2 + 1e-6 * w.abs())
    assert torch.equal(deq[5, 32:64], torch.full((32,), 0.75))
    groups, deq_groups = w.view(24, 3, 32), deq.view(24, 3, 32)
    assert torch.equal(deq_groups.amin(-1), groups.amin(-1))  # the minimum is q = 0
    torch.testing.assert_close(deq_groups.amax(-1), groups.amax(-1))  # the maximum is q = 15


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_layer_equals_its_dequantized_reference(method, dtype):
    sizes = [40, 24, 24]  # rows that are not multiples of the kernel's 16
    layer = meta_built(lambda: MergedLinear(96, sizes, bias=True, quant_method=METHODS[method][0]()))
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    layer = layer.to(dtype)
    reference = torch.cat([s.dequantize() for s in layer.quant_method.shards(layer)])
    bias = layer.bias.detach().clone()
    layer.quant_method.process_weights_after_loading(layer)
    assert [n for n, _ in layer.named_parameters()] == ["bias"]  # the dense weight is gone
    assert torch.equal(layer.packed.dequantize(), reference)  # packing loses nothing
    for rows in (1, 5, 40):
        x = torch.randn(rows, 96).to(dtype)
        assert_matches_reference(layer(x), F.linear(x, reference.to(dtype), bias),
                                 rtol=KERNEL_RTOL if dtype == torch.float32 else 0.03)


def write_dequantized_model(model_dir: Path, out: Path, method: str) -> Path:
    """A float copy of ``model_dir`` whose projections and LM head (untied, so that the embedding keeps its
    weight) hold ``method``'s dequantized weights: what heron's quantized model must compute."""
    _, quantize, group = METHODS[method]
    shutil.copytree(model_dir, out)
    tensors = load_file(model_dir / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    if config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
        config["tie_word_embeddings"] = False
        (out / "config.json").write_text(json.dumps(config))
    for name, w in tensors.items():
        if name == "lm_head.weight":  # int4's head is int8 (as llama.cpp keeps 4-bit models' output layer)
            tensors[name] = quantize_int8(w, int8_group(w.shape[1])).dequantize()
        elif name.endswith("_proj.weight"):
            tensors[name] = quantize(w, group(w.shape[1])).dequantize()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # a tied LM head, and an untied one with q/k/v biases
def test_model_logits_equal_the_dequantized_float_model(tiny_model_dir, tmp_path, method, arch):
    model_dir = tiny_model_dir(arch)
    float_dir = write_dequantized_model(model_dir, tmp_path / "dequantized", method)
    quantized = LLM(str(model_dir), block_size=8, dtype="float32", quantization=method)
    model = quantized.engine.core.runner.model
    assert isinstance(model.lm_head.quant_method, Int8LinearMethod) and not hasattr(model.lm_head, "weight")
    embedding = load_file(model_dir / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(model.embed_tokens.weight, embedding)  # the tied head's weight, still the embedding's
    reference = LLM(str(float_dir), block_size=8, dtype="float32")
    g = torch.Generator().manual_seed(0)
    for length in (40, 12):
        prompt = torch.randint(3, 300, (length,), generator=g).tolist()
        assert_matches_reference(heron_logits(quantized, prompt), heron_logits(reference, prompt), rtol=0.05)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_batched_greedy_equals_one_at_a_time(tiny_model_dir, method):
    # no prefix cache: a prompt alone computes what it computed in the batch, not only its last position
    llm = LLM(str(tiny_model_dir("llama")), block_size=8, dtype="float32", quantization=method,
              enable_prefix_caching=False)
    g = torch.Generator().manual_seed(1)
    lengths = [3, 30, 9, 17]  # the kernel computes each row as it would alone, at any batch size
    prompts = [{"prompt_token_ids": torch.randint(3, 300, (n,), generator=g).tolist()} for n in lengths]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(batch):
        return [o.outputs[0].token_ids for o in llm.generate(batch, greedy, use_tqdm=False)]

    assert run(prompts) == [run([p])[0] for p in prompts]


@pytest.mark.skipif(not INT_KERNEL, reason="needs heron's CPU kernels")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tokens_and_logprobs_do_not_depend_on_cache_chunks_or_batch(tiny_model_dir, dtype):
    """Where every query goes through the paged kernel (float32; bfloat16 without AMX, and with AMX for sequences
    of at most MAX_KERNEL_CONTEXT positions, as all of these) and every product through the integer kernel or the
    prompt copy's tile matmul, rows depend on their own position and input only: a prompt computed alone in one
    chunk, or in a batch in chunks of a small token budget after its prefix was cached, gives the same bits."""
    model = str(tiny_model_dir("llama"))
    common = {"block_size": 8, "dtype": dtype, "quantization": "int8"}
    alone = LLM(model, enable_prefix_caching=False, **common)
    shared = LLM(model, enable_prefix_caching=True, max_num_batched_tokens=24, **common)
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, 300, (32,), generator=g).tolist()
    prompts = [{"prompt_token_ids": prefix + torch.randint(3, 300, (n,), generator=g).tolist()}
               for n in (18, 5, 30, 1)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    assert all(kernel_takes(len(p["prompt_token_ids"]), len(p["prompt_token_ids"]) + 10) for p in prompts)

    def run(llm, batch):
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
                for o in llm.generate(batch, params, use_tqdm=False)]

    expected = [run(alone, [p])[0] for p in prompts]
    assert run(shared, prompts) == expected  # the shared prefix cached by the first prompt's chunks
    assert run(shared, prompts[::-1]) == expected[::-1]  # every prompt cached but its last block


@pytest.mark.skipif(not INT_KERNEL, reason="without heron's integer kernel every product dequantizes its whole "
                                           "weight: minutes on a real model")
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_default_gguf_model_is_requantized_and_batches_like_one_at_a_time(smollm2_path, method):
    # the GGUF is dequantized at load, then quantized again; rows are independent in the kernel
    llm = LLM(str(smollm2_path), dtype="float32", quantization=method, enable_prefix_caching=False)
    model = llm.engine.core.runner.model
    assert isinstance(model.layers[0].mlp.down_proj.quant_method, METHODS[method][0])
    assert isinstance(model.lm_head.quant_method, Int8LinearMethod)
    questions = ("What is the capital of France?", "Write a haiku about rivers.", "List three primes.")
    chats = [[{"role": "user", "content": text}] for text in questions]
    greedy = SamplingParams(temperature=0, max_tokens=16)

    def run(batch):
        return [o.outputs[0].token_ids for o in llm.chat(batch, greedy, use_tqdm=False)]

    together = run(chats)
    assert together == [run([chat])[0] for chat in chats] and all(together)


def test_bfloat16_int8_model_stays_close_to_the_float_model(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2")
    prompt = list(range(3, 43))
    quantized = heron_logits(LLM(str(model_dir), block_size=8, dtype="bfloat16", quantization="int8"), prompt)
    dense = heron_logits(LLM(str(model_dir), block_size=8, dtype="float32"), prompt)
    assert (quantized.float() - dense).norm() / dense.norm() < 0.05


@pytest.mark.skipif(not INT_KERNEL, reason="heron's integer kernel cannot be built here")
def test_a_packed_lm_head_gives_its_float32_sums_unrounded(tiny_model_dir):
    """The LM head's logits are the kernel's float32 sums (llama.cpp's are float32 too), not rounded to the model's
    bfloat16 first: the same int8 activations, so rounded they are the bfloat16 call's bits."""
    llm = LLM(str(tiny_model_dir("llama")), block_size=8, dtype="bfloat16", quantization="int4")
    head = llm.engine.core.runner.model.lm_head
    hidden = torch.randn(5, head.input_size, dtype=torch.bfloat16)
    logits = head(hidden)
    assert logits.dtype == torch.float32
    p = head.packed
    rounded = cpu_kernels().int_linear(hidden, p.qweight, p.scales, p.mins, p.bits, p.group, p.n, None)
    assert rounded.dtype == torch.bfloat16 and torch.equal(logits.to(torch.bfloat16), rounded)
    assert not torch.equal(logits, rounded.float())


def test_server_answers_a_completion_with_int8(tiny_model_dir, tmp_path):
    with ServerProcess(tiny_model_dir("llama"), "--quantization", "int8", "--max-model-len", "256",
                       log_path=tmp_path / "server.log") as server:
        completion = server.client().completions.create(model=str(tiny_model_dir("llama")), prompt="Hello",
                                                        max_tokens=5, temperature=0)
    assert completion.choices[0].finish_reason in ("length", "stop")
    assert 1 <= completion.usage.completion_tokens <= 5
