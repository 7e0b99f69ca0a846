"""The fp8 KV cache (``--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2``): quantization round trips and saturation,
calculated scales, the CPU paged kernel against the reference backend on one float8 pool, and the engine and
the server end to end on a tiny random model."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import assert_no_leaks

from heron import LLM, SamplingParams
from heron.attention.backend import AttentionBackend, get_attention_backend
from heron.attention.reference import ReferenceBackend
from heron.errors import ConfigError
from heron.kernels import cpu_kernels
from heron.quantization.kv import (
    K_SCALE_CONSTANT,
    V_SCALE_CONSTANT,
    KVScales,
    dequantize_kv,
    quantize_kv,
    resolve_kv_cache_dtype,
)

from ..server.conftest import ServerProcess
from .test_backends import BLOCK, DIM, KV_HEADS, by_slot, mixed_step

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# half a unit in the last place, relative (3 and 2 mantissa bits), and half the smallest subnormal
RELATIVE_ERROR = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}
SUBNORMAL_ERROR = {torch.float8_e4m3fn: 2.0**-10, torch.float8_e5m2: 2.0**-17}
needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="heron's CPU kernels cannot be built here")


def through_pool(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` as a float8 pool holding it with ``scale`` gives it back, in float32."""
    return dequantize_kv(quantize_kv(x, dtype, scale), torch.float32, scale)


def assert_within_precision(back: torch.Tensor, x: torch.Tensor, dtype: torch.dtype, scale: float) -> None:
    err = (back - x.float()).abs()
    bound = RELATIVE_ERROR[dtype] * x.float().abs() + SUBNORMAL_ERROR[dtype] * scale
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item()}"


def layer_backend(name: str, scales: KVScales) -> AttentionBackend:
    """Backend ``name`` as one layer holding ``scales`` sees it."""
    backend = get_attention_backend(name).for_layer()
    backend.kv_scales = scales
    return backend


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scale", [1.0, 0.01])
def test_round_trip_is_within_the_formats_precision_and_saturates_beyond_its_range(dtype, scale):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8192, generator=g) * torch.logspace(-6, 6, 8192)  # subnormals up to far past the range
    limit = torch.finfo(dtype).max
    inside = x.abs() / scale <= limit
    assert inside.any() and not inside.all()
    back = through_pool(x, dtype, scale)
    assert_within_precision(back[inside], x[inside], dtype, scale)
    # beyond the range: the largest finite value with x's sign, never an infinity or a NaN
    assert torch.equal(back[~inside], x[~inside].sign() * limit * scale)


@needs_kernels
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("activations", [torch.float32, torch.bfloat16])
def test_the_kernels_store_writes_the_bytes_of_the_pytorch_form(dtype, activations):
    g = torch.Generator().manual_seed(1)
    k = (torch.randn(40, KV_HEADS, DIM, generator=g) * torch.logspace(-6, 4, 40).view(-1, 1, 1)).to(activations)
    v = torch.randn(40, KV_HEADS, DIM, generator=g).to(activations)
    k[0, 0, :3] = torch.tensor([float("inf"), -1e30, 1e-30])
    slots = torch.randperm(48, generator=g)[:40]
    scales = KVScales(0.37, 0.05)
    pools = []
    for name in ("reference", "cpu_paged"):
        backend = layer_backend(name, scales)
        pool = torch.zeros(backend.kv_cache_shape(12, BLOCK, KV_HEADS, DIM), dtype=dtype)
        backend.store_kv(pool, k, v, slots)
        pools.append(by_slot(pool, backend))
    assert torch.equal(pools[0].view(torch.uint8), pools[1].view(torch.uint8))
    stored = pools[1][:, slots]
    assert stored[0, 0, 0, :2].float().tolist() == [torch.finfo(dtype).max, torch.finfo(dtype).min]
    assert_within_precision(dequantize_kv(stored[1], torch.float32, scales.v), v, dtype, scales.v)


@needs_kernels
@pytest.mark.parametrize("dtype", FP8)
# sixteen codes at a time (AVX-512), then eight, then one
@pytest.mark.parametrize("dim", [8, 5, 12, 29], ids=["vector", "tail", "both", "wide"])
def test_the_kernel_reads_every_float8_code_as_torch_does(dtype, dim):
    """One position per sequence: attention returns its value row, i.e. the pool's codes as the kernel reads
    them (NaN codes included)."""
    num_seqs = -(-256 // (KV_HEADS * dim))
    pool = torch.zeros(2, num_seqs, KV_HEADS, 1, dim, dtype=dtype)
    codes = torch.arange(256, dtype=torch.uint8).repeat(2)[:pool[1].numel()]
    pool[1].view(torch.uint8).copy_(codes.view(pool[1].shape))
    rows = torch.arange(num_seqs, dtype=torch.int32)
    out = cpu_kernels().paged_attention(torch.zeros(num_seqs, KV_HEADS, dim), pool, rows.view(-1, 1),
                                        torch.ones_like(rows), rows, rows + 1, 1.0, 0)
    torch.testing.assert_close(out, pool[1].flatten(1, 2).float(), atol=0, rtol=0, equal_nan=True)


@needs_kernels
@pytest.mark.parametrize("dtype", FP8)
def test_bfloat16_queries_score_every_finite_float8_key_code_at_head_dim_64(dtype):
    """With bfloat16 queries and head dim 64 the kernel scores from bfloat16 pairs, a float8 tile's keys converted
    to bfloat16 first. Sequence c has two positions, key 0 all code c with value 1, key 1 zero with value 0, so
    its output is sigmoid(score): every code's score, near +-2 where it is sensitive, equals torch's reading."""
    dim = 64
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[torch.isfinite(codes.view(dtype).float())]
    keys = codes.view(dtype).double()
    # one bfloat16 query element per sequence, so that code c scores about +-2 (code 0 scores 0)
    q = torch.where(keys == 0, 1.0, 2.0 / (keys.abs().clamp(min=1e-30) * dim)).to(torch.bfloat16)
    n = len(codes)
    pool = torch.zeros(2, n, 1, 2, dim, dtype=dtype)  # [2, blocks, kv_heads, block_size, dim]
    pool[0].view(torch.uint8)[:, 0, 0] = codes.view(n, 1)
    pool[1][:, 0, 0] = 1.0
    rows = torch.arange(n, dtype=torch.int32)
    out = cpu_kernels().paged_attention(q.view(n, 1, 1).expand(n, 1, dim).contiguous(), pool, rows.view(-1, 1),
                                        torch.full_like(rows, 2), rows, rows + 1, 1.0, 0)
    scores = keys * q.double() * dim
    expected = torch.sigmoid(scores).view(n, 1, 1).expand(n, 1, dim)
    torch.testing.assert_close(out.double(), expected.to(torch.bfloat16).double(), atol=0, rtol=8e-3)


@pytest.mark.parametrize("backend_name", ["reference", pytest.param("cpu_paged", marks=needs_kernels)])
def test_calculated_scales_are_set_by_the_first_batch_each_layer_stores(backend_name):
    g = torch.Generator().manual_seed(2)
    shared = get_attention_backend(backend_name)
    first, other = shared.for_layer(calculate_kv_scales=True), shared.for_layer(calculate_kv_scales=True)
    pool = torch.zeros(shared.kv_cache_shape(8, BLOCK, KV_HEADS, DIM), dtype=torch.float8_e4m3fn)
    k, v = 3 * torch.randn(5, KV_HEADS, DIM, generator=g), 0.5 * torch.randn(5, KV_HEADS, DIM, generator=g)
    first.store_kv(pool, k, v, torch.arange(5))
    scales = KVScales(k.abs().max().item() / K_SCALE_CONSTANT, v.abs().max().item() / V_SCALE_CONSTANT)
    assert first.kv_scales == scales  # vLLM's calc_kv_scales
    assert other.kv_scales == shared.kv_scales == KVScales()  # each layer has its own
    # the first batch lands well inside the range: it comes back within the format's precision
    stored = by_slot(pool, shared)[:, :5]
    assert_within_precision(dequantize_kv(stored[0], torch.float32, scales.k), k, torch.float8_e4m3fn, scales.k)
    # later batches keep the scales; a key beyond 448 x k_scale saturates
    first.store_kv(pool, 10 * k, v, torch.arange(5, 10))
    assert first.kv_scales == scales
    assert by_slot(pool, shared)[0, 5:10].float().abs().max() == 448
    other.store_kv(pool, torch.zeros_like(k), torch.zeros_like(v), torch.arange(10, 15))
    assert other.kv_scales == KVScales()  # all zeros: no scale to take, 1.0 kept


@needs_kernels
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("activations", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("scales", [KVScales(), KVScales(0.004, 0.03)], ids=["unit", "scaled"])
def test_cpu_paged_equals_the_reference_backend_on_the_same_fp8_contents(dtype, activations, window, scales):
    """Decodes, verification queries, prefill chunks over a cached prefix, GQA, windows; with k_scale 0.004 the
    larger keys saturate, and both backends must read back the same saturated values."""
    outs, pools = [], []
    for backend in (layer_backend("reference", scales), layer_backend("cpu_paged", scales)):
        pool = torch.zeros(backend.kv_cache_shape(64, BLOCK, KV_HEADS, DIM), dtype=dtype)
        step = mixed_step(backend, pool, activations)  # the same step for both: the same seed
        backend.prepare(step.meta)
        outs.append(backend.forward(step.q, step.k, step.v, pool, step.meta, window))
        pools.append(by_slot(pool, backend))
    assert torch.equal(pools[0].view(torch.uint8), pools[1].view(torch.uint8))
    expected = step.dense(window, [through_pool(k, dtype, scales.k) for k in step.keys],
                          [through_pool(v, dtype, scales.v) for v in step.values])
    tol = 1e-5 if activations == torch.float32 else 2e-2  # bfloat16: the dequantized values and output rounded
    for out in outs:
        assert out.dtype == activations
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)


def test_an_fp8_pool_the_backend_cannot_read_or_torch_cannot_hold_is_one_config_error(monkeypatch, tiny_model_dir):
    backend = ReferenceBackend()
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, backend) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, backend) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32, backend) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.float32, backend) == torch.float8_e5m2
    with monkeypatch.context() as m:
        m.delattr(torch, "float8_e5m2")
        with pytest.raises(ConfigError, match="needs a torch with float8 dtypes"):
            resolve_kv_cache_dtype("fp8_e5m2", torch.float32, backend)
    monkeypatch.setattr(ReferenceBackend, "supports_fp8_kv", False)  # the CPU paged backend inherits it
    with pytest.raises(ConfigError, match="cannot read an fp8 KV cache"):
        LLM(tiny_model_dir("llama"), kv_cache_dtype="fp8")


# ---- end to end ---------------------------------------------------------------------------------------------
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def random_prompts(n: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize(("kv_cache_dtype", "calculate_kv_scales", "pool_dtype"), [
    ("fp8", False, torch.float8_e4m3fn), ("fp8_e4m3", True, torch.float8_e4m3fn),
    ("fp8_e5m2", False, torch.float8_e5m2)])
@pytest.mark.parametrize("attention_backend", ["reference", pytest.param("cpu_paged", marks=needs_kernels)])
def test_fp8_engine_batched_equals_one_at_a_time_and_frees_every_block(llama_dir, kv_cache_dtype,
                                                                       calculate_kv_scales, pool_dtype,
                                                                       attention_backend):
    llm = LLM(llama_dir, block_size=8, max_num_batched_tokens=256, dtype="float32", kv_cache_dtype=kv_cache_dtype,
              calculate_kv_scales=calculate_kv_scales, attention_backend=attention_backend)
    runner = llm.engine.core.runner
    assert all(cache.dtype == pool_dtype for cache in runner.kv_caches)
    prompts = random_prompts(12, seed=0, lo=3, hi=70)
    together = [o.outputs[0].token_ids for o in run(llm, prompts)]
    scales = [layer.backend.kv_scales for layer in runner.layers]
    alone = [run(llm, [p])[0].outputs[0].token_ids for p in prompts]
    assert together == alone
    assert all(len(tokens) == GREEDY.max_tokens for tokens in together)
    assert llm.engine.stats().max_running_seen > 1
    # samples forked at the end of the prompt share its blocks, then copy the last one on write
    forked = run(llm, [prompts[0]], SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert [sample.token_ids for sample in forked.outputs] == [together[0]] * 3
    # calculated scales: one pair per layer from the first step, kept afterwards; else 1.0
    assert [layer.backend.kv_scales for layer in runner.layers] == scales
    if calculate_kv_scales:
        assert KVScales() not in scales and len(set(scales)) == len(scales)
    else:
        assert set(scales) == {KVScales()}
    assert_no_leaks(llm)


def test_an_fp8_pool_holds_2x_the_blocks_of_bfloat16_and_4x_of_float32(llama_dir, caplog):
    blocks, pool_bytes = {}, {}
    for dtype, kv in [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8"), ("float32", "fp8_e5m2")]:
        with caplog.at_level(logging.INFO, logger="heron.engine.core"):
            core = LLM(llama_dir, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory="1MiB").engine.core
        blocks[dtype, kv] = core.block_manager.num_blocks
        pool_bytes[dtype, kv] = core.runner.kv_cache_bytes
    assert blocks["bfloat16", "fp8"] == blocks["float32", "fp8_e5m2"] == 2 * blocks["bfloat16", "auto"] \
        == 4 * blocks["float32", "auto"]
    assert set(pool_bytes.values()) == {1 << 20}  # the same budget, fully used (no cap at these sizes)
    assert "KV float8_e4m3fn, 1-byte elements; bfloat16" in caplog.text
    assert "KV float32, 4-byte elements; float32" in caplog.text


def test_the_capacity_check_counts_fp8_blocks_and_suggests_fp8(llama_dir):
    # a 512-token sequence needs 32 blocks of 16: 64 KiB holds 16 bfloat16 blocks, or 32 fp8 ones
    with pytest.raises(ConfigError, match=r"--kv-cache-dtype fp8: 2x the tokens of a bfloat16 pool\), or lower "
                                          r"--max-model-len to at most 256"):
        LLM(llama_dir, dtype="bfloat16", kv_cache_memory="64KiB", max_model_len=512)
    llm = LLM(llama_dir, dtype="bfloat16", kv_cache_dtype="fp8", kv_cache_memory="64KiB", max_model_len=512)
    assert llm.engine.core.block_manager.num_blocks == 32


@pytest.mark.parametrize(("kv_cache_dtype", "calculate_kv_scales", "bound"), [
    ("fp8", False, 0.88), ("fp8", True, 0.88), ("fp8_e5m2", False, 0.78), ("fp8_e5m2", True, 0.78)])
def test_fp8_greedy_choices_agree_with_the_model_dtype_pool(llama_dir, kv_cache_dtype, calculate_kv_scales, bound):
    """At each position of long prompts (chunks of 16: the paged kernel's path), the greedy token of the bfloat16
    model over an fp8 pool against over a bfloat16 pool. Measured on this tiny random model (flat logits, so a
    near-tie flips easily): e4m3 0.92-0.94, e5m2 0.85-0.87; bfloat16 against float32 weights and pool agree
    at 0.98."""
    prompts = random_prompts(4, seed=3, lo=150, hi=200)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    top = {}
    for kv, calc in [("auto", False), (kv_cache_dtype, calculate_kv_scales)]:
        llm = LLM(llama_dir, dtype="bfloat16", kv_cache_dtype=kv, calculate_kv_scales=calc,
                  max_num_batched_tokens=16, kv_cache_memory="4MiB")
        top[kv] = [next(t for t, lp in position.items() if lp.rank == 1)
                   for out in run(llm, prompts, params) for position in out.prompt_logprobs[1:]]
        assert_no_leaks(llm)
    agreement = sum(a == b for a, b in zip(top["auto"], top[kv_cache_dtype], strict=True)) / len(top["auto"])
    assert agreement >= bound, agreement


def test_the_server_answers_with_an_fp8_kv_cache(llama_dir, tmp_path):
    with ServerProcess(llama_dir, "--kv-cache-dtype", "fp8", "--calculate-kv-scales", "--max-model-len", "256",
                       "--kv-cache-memory", "1MiB", log_path=tmp_path / "server.log") as server:
        out = server.client().completions.create(model=str(llama_dir), prompt="Hello, world!", max_tokens=8,
                                                 temperature=0)
        assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens >= 1
        assert "KV float8_e4m3fn, 1-byte elements" in server.log()
