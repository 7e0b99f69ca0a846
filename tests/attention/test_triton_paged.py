"""The Triton paged-attention backend against dense attention on mixed steps, over contexts of many tiles, and
through the engine against the reference backend: on a GPU where there is one, else in Triton's interpreter on
the CPU (tests/conftest.py sets ``TRITON_INTERPRET=1`` there).

The interpreter checks the kernel's indexing, masking and online softmax as written, not its compilation for a
GPU (``benchmarks/gpu_check.sh`` runs this file where a GPU is lent). bfloat16 is left out on the CPU: the
interpreter's bfloat16 dot products are wrong (a 16 x 16 product off by 1e10); float16 takes the same
half-precision path.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from heron import LLM, SamplingParams
from heron.attention.backend import AttentionMetadata, get_attention_backend
from tests.attention.test_backends import BLOCK, DIM, KV_HEADS, STEP, MixedStep, mixed_step
from tests.helpers import assert_no_leaks, build_tiny_model

pytest.importorskip("triton")

from heron.attention.triton_paged import TILE_N, TritonPagedBackend  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def on_device(step: MixedStep) -> MixedStep:
    meta = step.meta
    meta = dataclasses.replace(meta, query_start_loc=meta.query_start_loc.to(DEVICE), seq_lens=meta.seq_lens.to(DEVICE),
                               block_table=meta.block_table.to(DEVICE), slot_mapping=meta.slot_mapping.to(DEVICE))
    return dataclasses.replace(step, q=step.q.to(DEVICE), k=step.k.to(DEVICE), v=step.v.to(DEVICE), meta=meta)


# contexts of several TILE_N tiles: decodes deep into a context, a chunk over a long cached prefix, a long prompt
LONG_STEP = [(3 * TILE_N + 5, 1), (2 * TILE_N - 3, TILE_N + 7), (0, 2 * TILE_N + 11), (TILE_N, 4)]


@pytest.mark.parametrize("shape", [STEP, LONG_STEP], ids=["mixed", "long"])
@pytest.mark.parametrize("window", [None, 5, TILE_N + 9])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_paged_equals_dense_attention(shape, window, dtype):
    backend = get_attention_backend("triton_paged")
    cache = torch.zeros(backend.kv_cache_shape(128, BLOCK, KV_HEADS, DIM), dtype=dtype)
    step = mixed_step(backend, cache, dtype, shape=shape)
    step, cache = on_device(step), cache.to(DEVICE)
    backend.prepare(step.meta)
    out = backend.forward(step.q, step.k, step.v, cache, step.meta, window)
    assert out.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]  # half precision: output rounding
    torch.testing.assert_close(out.float().cpu(), step.dense(window), atol=tol, rtol=tol)


def test_triton_paged_reads_strided_queries_of_many_heads():
    # the model's q is a view of the fused projection (rows strided past the heads), 3 query heads per KV head
    heads, kv_heads, dim = 9, 3, 64
    backend = get_attention_backend("triton_paged")
    reference = get_attention_backend("reference")
    cache = torch.zeros(backend.kv_cache_shape(32, 16, kv_heads, dim), device=DEVICE)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(70, (heads + 2 * kv_heads) * dim, generator=g).to(DEVICE)
    q = qkv[:, :heads * dim].view(70, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(70, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(70, kv_heads, dim)
    assert not q.is_contiguous()

    def meta():  # one prompt of 60 tokens, then a decode of one (slots 0..69 of blocks 3, 1, 4, 0, 2)
        table = torch.tensor([[3, 1, 4, 0, 2], [2, 0, 4, 1, 3]], dtype=torch.int32)
        slots = [int(table[0, p // 16]) * 16 + p % 16 for p in range(60)]
        slots += [int(table[1, p // 16]) * 16 + p % 16 for p in range(60, 70)]
        return AttentionMetadata(torch.tensor([0, 60, 70], dtype=torch.int32, device=DEVICE),
                                 torch.tensor([60, 10], dtype=torch.int32, device=DEVICE), table.to(DEVICE),
                                 torch.tensor(slots, device=DEVICE), [60, 10], [60, 10], 16)

    expected_cache = cache.clone()
    m = meta()
    reference.prepare(m)
    expected = reference.forward(q, k, v, expected_cache, m)
    m = meta()
    backend.prepare(m)
    out = backend.forward(q, k, v, cache, m)
    assert torch.equal(cache, expected_cache)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_triton_paged_refuses_the_cpu_outside_the_interpreter(monkeypatch, tmp_path):
    backend = get_attention_backend("triton_paged")  # built under the interpreter (or for a GPU)
    cache = torch.zeros(backend.kv_cache_shape(64, BLOCK, KV_HEADS, DIM))
    step = mixed_step(backend, cache, torch.float32)
    backend.prepare(step.meta)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="runs on CUDA"):
        backend.forward(step.q, step.k, step.v, cache, step.meta)
    # an engine on the CPU is refused at start, not at its first request
    with pytest.raises(ValueError, match="runs on CUDA"):
        LLM(model=str(build_tiny_model("llama", tmp_path / "llama")), attention_backend="triton_paged",
            device="cpu", max_model_len=128)


def test_engine_on_triton_paged_matches_the_reference_backend(tmp_path, monkeypatch):
    # prefix caching and a small token budget: prompt chunks over cached prefixes and decodes in the same steps
    path = build_tiny_model("llama", tmp_path / "llama")
    prompts = [[5 + (7 * i + j) % 200 for j in range(n)] for i, n in enumerate([9, 40, 3, 75])]
    prompts.append(prompts[1][:33] + [17, 18])  # shares two blocks with the second prompt
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=1, ignore_eos=True)
    calls = []
    forward = TritonPagedBackend.forward
    monkeypatch.setattr(TritonPagedBackend, "forward", lambda self, *a: calls.append(1) or forward(self, *a))
    results = {}
    for name in ("reference", "triton_paged"):
        llm = LLM(model=str(path), dtype="float32", attention_backend=name, max_model_len=256, block_size=16,
                  max_num_batched_tokens=64, seed=0, device=DEVICE.type)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[name] = [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                               o.outputs[0].token_ids, strict=True)])
                         for o in outs]
        assert_no_leaks(llm)
    assert calls  # the engine's layers went through the kernel (not the CPU decoder stack)
    for (ref_ids, ref_lps), (ids, lps) in zip(results["reference"], results["triton_paged"], strict=True):
        assert ids == ref_ids
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), atol=1e-4, rtol=1e-4)


def test_triton_paged_without_triton_is_a_config_error(monkeypatch):
    import heron.attention.triton_paged as module
    from heron.errors import ConfigError

    monkeypatch.setattr(module, "triton_available", lambda: False)
    with pytest.raises(ConfigError, match="needs Triton"):
        get_attention_backend("triton_paged")


def test_triton_paged_refuses_an_fp8_pool(tmp_path):
    path = build_tiny_model("llama", tmp_path / "llama")
    with pytest.raises(Exception, match="fp8|float8"):
        LLM(model=str(path), attention_backend="triton_paged", kv_cache_dtype="fp8", max_model_len=128)
