"""heron's C++ CPU ops against the PyTorch forms they replace."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from heron.kernels import _CSRC, build_dir_of, cpu_kernels, load_cpu_kernels
from heron.layers.activation import SiluAndMul
from heron.layers.norm import RMSNorm
from heron.layers.rotary import RopeInputs, RotaryEmbedding

kernels = cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="heron's CPU kernels cannot be built here")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@contextlib.contextmanager
def pytorch_ops():
    """Layers take their PyTorch form inside the block."""
    old = os.environ.get("HERON_CPU_KERNELS")
    os.environ["HERON_CPU_KERNELS"] = "0"
    cpu_kernels.cache_clear()
    try:
        yield
    finally:
        if old is None:
            del os.environ["HERON_CPU_KERNELS"]
        else:
            os.environ["HERON_CPU_KERNELS"] = old
        cpu_kernels.cache_clear()


def test_kernels_build_wherever_a_compiler_exists():
    """A broken build must fail here, not skip every test below."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    load_cpu_kernels()


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("c++") is None, reason="x86 with a C++ compiler")
@pytest.mark.parametrize("arch", [["-march=x86-64-v3"], ["-march=icelake-server", "-mavx512bf16"],
                                  ["-march=sapphirerapids"]], ids=["avx2", "avx512-bf16-zen4", "amx"])
def test_kernels_compile_for_every_x86_level(arch):
    """The build is ``-march=native``: a source that compiles only with (or only without) AMX or AVX-512 breaks
    the build on the other machines (Zen 4 has AVX-512 and its bfloat16 but no AMX; Sapphire Rapids has AMX;
    AVX2-only hosts neither). Compile each source for each level, without code generation."""
    from torch.utils.cpp_extension import include_paths

    from heron.kernels import _SOURCES

    includes = [f"-I{_CSRC}", f"-I{sysconfig.get_paths()['include']}", *(f"-I{p}" for p in include_paths())]
    compiles = {source.name: subprocess.Popen(
        ["c++", "-fsyntax-only", "-std=c++20", "-fopenmp", *arch, "-DTORCH_EXTENSION_NAME=heron_cpu_kernels",
         "-DTORCH_API_INCLUDE_EXTENSION_H", *includes, str(source)], stderr=subprocess.PIPE, text=True)
        for source in _SOURCES}
    for name, compile_ in compiles.items():
        errors = compile_.communicate(timeout=600)[1]
        assert compile_.returncode == 0, f"{name} for {arch}:\n{errors[-3000:]}"


@needs_kernels
def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_load():
    """torch's build lock is a file: a server killed while compiling left it, and every later start waited on it
    forever. A fresh process must load the (built) kernels regardless."""
    build_dir = Path(load_cpu_kernels().__file__).parent
    (build_dir / "lock").touch()  # as a process killed mid-build leaves it
    subprocess.run([sys.executable, "-c", "from heron.kernels import load_cpu_kernels; load_cpu_kernels()"],
                   check=True, timeout=180)
    assert not (build_dir / "lock").exists()


def test_the_same_sources_in_another_checkout_build_apart(tmp_path):
    """torch rebuilds a build directory whose include path changed: two checkouts sharing one would rebuild it
    each time the other loaded it. Each gets its own; a changed source gets another one too."""
    other = tmp_path / "csrc"
    shutil.copytree(_CSRC, other)
    assert build_dir_of(other) != build_dir_of(_CSRC)
    assert build_dir_of(other) == build_dir_of(other)
    first = build_dir_of(other)
    (other / "cpu_ops.cpp").write_text((other / "cpu_ops.cpp").read_text() + "\n// changed\n")
    assert build_dir_of(other) != first


def tolerance(dtype: torch.dtype) -> dict:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual_matches_the_unfused_form(dtype):
    norm = RMSNorm(96, 1e-5)
    torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    norm = norm.to(dtype)
    x, residual = torch.randn(7, 96, dtype=dtype), torch.randn(7, 96, dtype=dtype)
    out, summed = norm(x, residual.clone())
    with pytorch_ops():
        ref_out, ref_sum = norm(x, residual.clone())
        ref_plain = norm(x)
    torch.testing.assert_close(summed, ref_sum, atol=0, rtol=0)  # the sum is rounded to dtype, as x + r is
    torch.testing.assert_close(out, ref_out, **tolerance(dtype))
    torch.testing.assert_close(norm(x), ref_plain, **tolerance(dtype))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_strided_views_matches_the_pytorch_form(dtype):
    from transformers import LlamaConfig

    heads, kv_heads, dim = 4, 2, 16
    rotary = RotaryEmbedding(LlamaConfig(head_dim=dim, rope_theta=10000.0), dim, 64)
    fused = torch.randn(5, (heads + 2 * kv_heads) * dim, dtype=dtype)  # a q/k/v projection's output
    q = fused[:, : heads * dim].view(5, heads, dim)
    k = fused[:, heads * dim: (heads + kv_heads) * dim].view(5, kv_heads, dim)
    positions = torch.tensor([0, 3, 9, 10, 63])
    cos = rotary.cos[positions].unsqueeze(1).to(dtype)
    sin = rotary.sin[positions].unsqueeze(1).to(dtype)
    ref_q, ref_k = rotary(RopeInputs(positions, cos, sin), q.clone(), k.clone())
    v_before = fused[:, (heads + kv_heads) * dim:].clone()
    got_q, got_k = rotary(RopeInputs(positions), q, k)
    assert got_q.data_ptr() == q.data_ptr()  # in place, in the fused tensor
    torch.testing.assert_close(got_q, ref_q, **tolerance(dtype))
    torch.testing.assert_close(got_k, ref_k, **tolerance(dtype))
    assert torch.equal(fused[:, (heads + kv_heads) * dim:], v_before)  # values untouched


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_the_pytorch_form(dtype):
    x = torch.randn(6, 2 * 40, dtype=dtype)
    gate, up = x.float().chunk(2, dim=-1)
    torch.testing.assert_close(SiluAndMul()(x).float(), torch.nn.functional.silu(gate) * up, **tolerance(dtype))


@needs_kernels
def test_store_kv_writes_strided_rows_into_their_slots_and_skips_negative_ones():
    cache = torch.zeros(2, 3, 2, 4, 8)  # [2, blocks, kv_heads, block_size, dim]
    fused = torch.randn(3, 3 * 16)
    k, v = fused[:, 16:32].view(3, 2, 8), fused[:, 32:].view(3, 2, 8)
    kernels.store_kv(k, v, cache, torch.tensor([5, -1, 11]))
    flat = cache.transpose(2, 3).flatten(1, 2)  # [2, slots, kv_heads, dim]
    assert torch.equal(flat[0, 5], k[0]) and torch.equal(flat[1, 11], v[2])
    assert flat[:, [i for i in range(12) if i not in (5, 11)]].abs().sum() == 0
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.store_kv(k, v, cache, torch.tensor([0, 1, 12]))


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_gemv_bf16_equals_a_float32_matmul_rounded_once(rows):
    torch.manual_seed(rows)
    x = torch.randn(rows, 77, dtype=torch.bfloat16)
    w = torch.randn(301, 77, dtype=torch.bfloat16)  # neither size a multiple of the kernel's tiles
    bias = torch.randn(301, dtype=torch.bfloat16)
    expected = (x.float() @ w.float().T + bias.float()).to(torch.bfloat16)
    got = kernels.gemv_bf16(x, w, bias)
    # float32 sums in another order: at most one bfloat16 rounding step apart
    torch.testing.assert_close(got.float(), expected.float(), atol=0.05, rtol=8e-3)
    with pytest.raises(RuntimeError, match="M <= 4"):
        kernels.gemv_bf16(torch.randn(5, 77, dtype=torch.bfloat16), w, None)


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_with_cpu_kernels_equals_its_pytorch_form(tiny_model_dir, arch, dtype):
    """Whole forwards (prefill, then decode steps through the fused ops and the one-row matmul) agree."""
    from helpers import heron_logits

    from heron import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir(arch)), block_size=8, dtype=dtype)
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    fused_logits = heron_logits(llm, prompt)
    fused_tokens = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    with pytorch_ops():
        ref_logits = heron_logits(llm, prompt)
        ref_tokens = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    if dtype == "float32":
        torch.testing.assert_close(fused_logits, ref_logits, atol=1e-4, rtol=1e-4)
        assert fused_tokens == ref_tokens
    else:  # rounding differs (one rounding per fused op instead of one per PyTorch op): close, not equal
        assert (fused_logits - ref_logits).abs().max() < 0.1 * ref_logits.abs().max()
        assert fused_tokens[:4] == ref_tokens[:4]


def test_a_failed_build_falls_back_to_pytorch_ops_and_the_reference_backend(monkeypatch, caplog):
    """No compiler (or a broken one): one warning, and the engine still runs, on PyTorch ops."""
    import heron.attention.cpu_paged as cpu_paged
    import heron.kernels as heron_kernels
    from heron.attention.backend import get_attention_backend

    def no_compiler():
        raise RuntimeError("c++: command not found")

    monkeypatch.setattr(heron_kernels, "load_cpu_kernels", no_compiler)
    monkeypatch.setattr(cpu_paged, "load_cpu_kernels", no_compiler)
    cpu_kernels.cache_clear()
    try:
        assert heron_kernels.cpu_kernels() is None
        assert get_attention_backend("auto").name == "reference"
        with pytest.raises(RuntimeError, match="command not found"):
            get_attention_backend("cpu_paged")  # asked for by name: the error, not a silent fallback
        norm = RMSNorm(16)
        x = torch.randn(3, 16)
        torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (16,), norm.weight, norm.eps))
    finally:
        cpu_kernels.cache_clear()
    assert "could not be built" in caplog.text


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kernel_takes_zero_rows(dtype):
    """A step may hand a layer no rows (a prompt chunk none of whose outputs is wanted, past the last layer's
    attention): each kernel returns an empty result instead of dividing by zero (int_linear did: SIGFPE)."""
    from transformers import LlamaConfig

    from heron.quantization.base import tile_packed
    from heron.quantization.packed_int import IntShard, pack, row_scale_copy

    empty = torch.empty(0, 64, dtype=dtype)
    packed = pack(IntShard(torch.randint(0, 16, (48, 64), dtype=torch.uint8), torch.rand(48, 2), torch.rand(48, 2),
                           4, 32))
    assert kernels.int_linear(empty, packed.qweight, packed.scales, packed.mins, 4, 32, 48, None).shape == (0, 48)
    if kernels.row_scale_available():
        copy = row_scale_copy(packed)
        assert kernels.int_linear_row_scale(empty, copy.qweight, copy.scales, copy.mins, 48, None).shape == (0, 48)
    weight = torch.randn(48, 64, dtype=torch.bfloat16)
    if (tiles := tile_packed(weight)) is not None:
        assert kernels.tile_linear(empty.bfloat16(), tiles, None, 48).shape == (0, 48)
    assert kernels.gemv_bf16(empty.bfloat16(), weight, None).shape == (0, 48)
    assert kernels.rms_norm(empty, empty.clone(), torch.ones(64, dtype=dtype), 1e-6).shape == (0, 64)
    assert kernels.silu_and_mul(empty).shape == (0, 32)
    assert kernels.argmax_rows(torch.empty(0, 10)).shape == (0,)
    q, k = torch.empty(0, 4, 16, dtype=dtype), torch.empty(0, 2, 16, dtype=dtype)
    rotary = RotaryEmbedding(LlamaConfig(head_dim=16, rope_theta=10000.0), 16, 32)
    kernels.rotary_embedding(torch.empty(0, dtype=torch.long), q, k, rotary.cos, rotary.sin)
    cache = torch.zeros(2, 2, 2, 16, 16, dtype=dtype)
    kernels.store_kv(k, k, cache, torch.empty(0, dtype=torch.long))
    assert cache.abs().sum() == 0
    none = torch.zeros(1, dtype=torch.int32)
    out = kernels.paged_attention(q, cache, torch.zeros(1, 1, dtype=torch.int32), none, none, none, 0.25, 0)
    assert out.shape == (0, 4, 16)
