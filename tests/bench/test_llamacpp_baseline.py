"""The llama.cpp launcher: its command line and the cached build."""

from __future__ import annotations

from pathlib import Path

from heron.bench.baselines import llamacpp


def test_server_command_enables_continuous_batching_with_one_context_per_slot():
    cmd = llamacpp.server_command(Path("/m/model.gguf"), "127.0.0.1", 8002, parallel=16, slot_ctx=512, threads=2,
                                  alias="smollm2-135m-instruct", binary=Path("/bin/llama-server"))
    assert cmd[0] == "/bin/llama-server"
    assert "--cont-batching" in cmd
    assert cmd[cmd.index("--parallel") + 1] == "16"
    assert cmd[cmd.index("--ctx-size") + 1] == str(16 * 512)
    assert cmd[cmd.index("-m") + 1] == "/m/model.gguf" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--alias") + 1] == "smollm2-135m-instruct"
    assert cmd[cmd.index("--threads") + 1] == "2"


def test_isa_flags_follow_the_cpu_and_never_enable_amx():
    spr = frozenset({"avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"})
    flags = llamacpp.isa_flags(spr)
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX512=ON" in flags and "-DGGML_AVX512_BF16=ON" in flags
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(flags)
    assert not any(f.startswith("-DGGML_AMX") and f.endswith("=ON") for f in flags)
    avx2_only = llamacpp.isa_flags(frozenset({"avx", "avx2", "fma", "f16c"}))
    assert "-DGGML_AVX2=ON" in avx2_only and "-DGGML_AVX512=OFF" in avx2_only


def test_builds_for_different_cpus_live_apart(monkeypatch):
    monkeypatch.setattr("heron.cpu.cpu_flags", lambda: frozenset({"avx2"}))
    one = llamacpp.build_dir()
    monkeypatch.setattr("heron.cpu.cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    assert llamacpp.build_dir() != one


def test_build_reuses_the_cached_binary(tmp_path, monkeypatch):
    monkeypatch.setenv("HERON_CACHE", str(tmp_path))
    binary = llamacpp.server_binary()
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    monkeypatch.setattr(llamacpp, "_run", lambda *a: (_ for _ in ()).throw(AssertionError("must not rebuild")))
    assert llamacpp.build() == binary


def test_python_fallback_command():
    cmd = llamacpp.python_server_command(Path("/m.gguf"), "127.0.0.1", 8002, 2048, None, "x")
    assert cmd[1:3] == ["-m", "llama_cpp.server"] and "--n_ctx" in cmd and "--n_threads" not in cmd
