"""Integer-weight layers with a copy for prompt tokens (heron/quantization/packed_int.py): prompt rows go through
heron's bfloat16 matmul on a bfloat16 copy (kernels.tile_linear, CPUs with AMX) or through the integer kernel on
an 8-bit copy with one scale per output row (kernels.int_linear_row_scale, AVX-512 VNNI without AMX), every
other row through the integer kernel exactly as without it, so a row's result in these layers never depends on
its batch, its prompt's chunks or prefix-cache hits."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from helpers import heron_logits, write_gguf

from heron import LLM, SamplingParams
from heron.kernels import cpu_kernels
from heron.layers.prompt_rows import current_rows, step_rows
from heron.quantization import base, packed_int
from heron.quantization.base import tile_packed
from heron.quantization.packed_int import IntShard, PackedInt, linear, pack, prompt_weight_of, row_scale_copy

needs_tiles = pytest.mark.skipif(cpu_kernels() is None or not cpu_kernels().tile_linear_available(),
                                 reason="needs heron's CPU kernels on a CPU with AMX or AVX-512 BF16")
needs_row_scale = pytest.mark.skipif(cpu_kernels() is None or not cpu_kernels().row_scale_available(),
                                     reason="needs heron's CPU kernels on a CPU with AVX-512 VNNI")
COPIES = [pytest.param("tiles", marks=needs_tiles), pytest.param("8-bit", marks=needs_row_scale)]


def copy_of(packed: packed_int.PackedInt, kind: str) -> packed_int.PromptWeight:
    return tile_packed(packed.dequantize(torch.bfloat16)) if kind == "tiles" else row_scale_copy(packed)


def test_step_rows_name_the_prompt_rows_of_each_sequence():
    with step_rows([1, 5, 3], [0, 5, 2]):
        rows = current_rows()
        assert rows.prompt.tolist() == [1, 2, 3, 4, 5, 6, 7]
        assert rows.other.tolist() == [0, 8]
    assert current_rows().prompt is None  # outside the step
    with step_rows([1, 1], [0, 0]):  # decodes only: nothing to split
        assert current_rows().prompt is None and current_rows().other is None
    with step_rows([40], [40]):
        assert current_rows().other is None


def random_packed(n: int = 96, k: int = 256, bits: int = 4, group: int = 32) -> packed_int.PackedInt:
    g = torch.Generator().manual_seed(n + k)
    return pack(IntShard(torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=g),
                         torch.rand(n, k // group, generator=g) / 50, -torch.rand(n, k // group, generator=g) / 10,
                         bits, group))


@pytest.mark.parametrize("kind", COPIES)
def test_prompt_rows_take_the_copy_the_others_the_integer_kernel_each_row_alike_in_any_step(kind):
    packed = random_packed()
    copy = copy_of(packed, kind)
    bias = torch.randn(packed.n).bfloat16()
    query_lens, prompt_rows = [3, 150, 1, 30], [3, 150, 0, 29]  # 30: a prompt's last token and a draft
    x = torch.randn(sum(query_lens), packed.k).bfloat16()
    with step_rows(query_lens, prompt_rows):
        out = linear(x, packed, bias, copy)
    other = torch.tensor([153, 183])
    prompt = torch.tensor([i for i in range(len(x)) if i not in (153, 183)])
    # the other rows are the integer kernel's, as without a copy or a step layout
    torch.testing.assert_close(out[other], linear(x[other], packed, bias), atol=0, rtol=0)
    assert not torch.equal(out[prompt], linear(x[prompt], packed, bias))  # another kernel...
    reference = F.linear(x[prompt].float(), packed.dequantize(), bias.float())
    torch.testing.assert_close(out[prompt].float(), reference, atol=0.05, rtol=0.02)  # ...the same product
    # alone, or as another step's prompt rows: in other tile rows, other row blocks, beside other rows
    for part in (prompt[:5], prompt[100:170], prompt[-1:], prompt[3:150]):
        with step_rows([len(part)], [len(part)]):
            torch.testing.assert_close(linear(x[part], packed, bias, copy), out[part], atol=0, rtol=0)


def test_the_copy_is_bfloat16_tiles_with_amx_8_bits_with_vnni_only_for_bfloat16_and_memory(monkeypatch):
    packed = random_packed()
    kernels = cpu_kernels()
    tiles = kernels is not None and kernels.tile_linear_available()
    amx = tiles and kernels.tile_linear_amx()
    copy = prompt_weight_of(packed, torch.bfloat16)
    if amx:
        assert isinstance(copy, torch.Tensor)
    elif kernels is not None and kernels.row_scale_available():  # AVX-512 BF16 vectors lose to the integer kernel
        assert isinstance(copy, PackedInt) and (copy.bits, copy.group, copy.n, copy.k) == (8, packed.k, 96, 256)
    else:
        assert copy is None
    assert prompt_weight_of(packed, torch.float32) is None
    monkeypatch.setenv("HERON_PROMPT_WEIGHTS", "1")  # asked for: wherever tile_linear runs
    assert (prompt_weight_of(packed, torch.bfloat16) is not None) == tiles
    monkeypatch.setenv("HERON_PROMPT_WEIGHTS", "0")
    assert prompt_weight_of(packed, torch.bfloat16) is None
    monkeypatch.delenv("HERON_PROMPT_WEIGHTS")
    monkeypatch.setattr(base, "available_memory", lambda: 0)  # the copy would not fit
    assert prompt_weight_of(packed, torch.bfloat16) is None


@needs_tiles
@pytest.mark.parametrize("n, k", [(96, 256), (100, 64), (3072, 576), (40, 1536)])
def test_tile_linear_is_the_product_and_each_rows_bits_do_not_depend_on_its_batch(n, k):
    g = torch.Generator().manual_seed(n)
    w, bias = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    x = torch.randn(600, k, generator=g).bfloat16()
    kernels, copy = cpu_kernels(), tile_packed(w)
    out = kernels.tile_linear(x, copy, bias, n)
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float(), bias.float()), atol=0.05, rtol=0.02)
    # rows alone, in other row blocks and tile rows, or as a strided view
    for rows in (slice(0, 1), slice(7, 40), slice(250, 600), slice(3, 600, 2)):
        torch.testing.assert_close(kernels.tile_linear(x[rows], copy, bias, n), out[rows], atol=0, rtol=0)
    assert torch.equal(kernels.tile_linear(x[:0], copy, None, n), out[:0])


@needs_tiles
def test_the_vector_path_passes_the_same_checks_where_amx_is_turned_off():
    """An AMX machine runs tile_linear's AVX-512 BF16 loop (Zen 4's path) with HERON_AMX=0: the test above in a
    process of its own (the kernels read the variable once)."""
    if not cpu_kernels().tile_linear_amx():
        pytest.skip("this CPU runs the vector loop in the test above")
    test = f"{__file__}::test_tile_linear_is_the_product_and_each_rows_bits_do_not_depend_on_its_batch"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                         env={**os.environ, "HERON_AMX": "0"}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "4 passed" in run.stdout


@pytest.mark.parametrize("kind", COPIES)
@pytest.mark.parametrize("weights", ["int4", "gguf-q4_1"])
def test_a_model_with_prompt_copies_batches_like_one_at_a_time_and_stays_close_to_the_kernel(
        tiny_model_dir, tmp_path, monkeypatch, weights, kind):
    if kind == "tiles":
        monkeypatch.setenv("HERON_PROMPT_WEIGHTS", "1")  # the bfloat16 copy on CPUs without AMX too
    elif cpu_kernels().tile_linear_amx():
        pytest.skip("with AMX the copy is the bfloat16 one")
    if weights == "int4":
        model, quantization = tiny_model_dir(), "int4"
    else:
        model, quantization = write_gguf(tiny_model_dir(), tmp_path / "tiny.gguf", GGMLQuantizationType.Q4_1), None
    prompts = [list(range(5, 45)), [7, 8, 9], list(range(100, 130)), list(range(5, 200))]

    def make() -> LLM:
        # bfloat16 attention takes SDPA for long prompt chunks, the kernel for short ones: a prompt cut into
        # other chunks, or replayed after a prefix-cache hit, may differ there in its last bits (not tested here)
        return LLM(model=str(model), dtype="bfloat16", quantization=quantization, max_model_len=256,
                   enable_prefix_caching=False, seed=0)

    def generate(llm: LLM, batch: list[list[int]]) -> list[tuple[list[int], list]]:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    llm = make()
    runner_model = llm.engine.core.runner.model
    copy_type = torch.Tensor if kind == "tiles" else PackedInt
    assert isinstance(runner_model.layers[0].mlp.gate_up_proj.prompt_weight, copy_type)
    if weights != "int4":  # GGUF packs the LM head too, but its rows are the sampled ones, not a step's
        assert runner_model.lm_head.packed is not None and runner_model.lm_head.prompt_weight is None
    alone = [generate(llm, [p])[0] for p in prompts]
    assert generate(llm, prompts) == alone

    monkeypatch.setenv("HERON_PROMPT_WEIGHTS", "0")
    without = make()
    assert without.engine.core.runner.model.layers[0].mlp.gate_up_proj.prompt_weight is None
    torch.testing.assert_close(heron_logits(llm, prompts[0]), heron_logits(without, prompts[0]), atol=0.1, rtol=0.05)


@needs_row_scale
@pytest.mark.parametrize("n, k", [(96, 256), (40, 1536), (3072, 576)])
def test_the_8_bit_copy_is_the_product_and_each_rows_bits_do_not_depend_on_its_batch(n, k):
    packed = random_packed(n, k)
    copy = row_scale_copy(packed)
    bias = torch.randn(n).bfloat16()
    x = torch.randn(300, k).bfloat16()
    run = cpu_kernels().int_linear_row_scale
    out = run(x, copy.qweight, copy.scales, copy.mins, n, bias)
    reference = F.linear(x.float(), packed.dequantize(), bias.float())
    error = (out.float() - reference).norm() / reference.norm()
    assert error < 0.01
    # the copy's rounding adds less than the kernel's own (its activations' int8 rounding): 0.0057-0.0072 against
    # 0.0045-0.0053 for these shapes, where every 32 weights span their own range
    kernel = cpu_kernels().int_linear(x, packed.qweight, packed.scales, packed.mins, 4, 32, n, bias).float()
    assert error < 1.5 * (kernel - reference).norm() / reference.norm()
    # one row, a few (one pass), more (passes of four, a remainder), alone or in the middle of a batch
    for rows in (slice(0, 1), slice(3, 8), slice(10, 15), slice(41, 300)):
        torch.testing.assert_close(run(x[rows].contiguous(), copy.qweight, copy.scales, copy.mins, n, bias), out[rows],
                                   atol=0, rtol=0)


def test_the_8_bit_copy_needs_the_memory(monkeypatch):
    monkeypatch.setattr(base, "available_memory", lambda: 0)
    assert row_scale_copy(random_packed()) is None
