"""Device/dtype choice and KV-cache sizing, CUDA paths included (with mocked device queries)."""

from __future__ import annotations

import pytest
import torch

from heron.config import EngineConfig, parse_size
from heron.engine import memory
from heron.errors import ConfigError

GiB = 1 << 30


def test_parse_size():
    assert parse_size("2GiB") == 2 * GiB
    assert parse_size("512MB") == 512 * 10**6
    assert parse_size("1024") == 1024
    with pytest.raises(ConfigError):
        parse_size("lots")


def test_auto_device_and_dtype(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert memory.resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(memory, "has_native_bf16", lambda: False)
    assert memory.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    monkeypatch.setattr(memory, "has_native_bf16", lambda: True)
    assert memory.resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    assert memory.resolve_dtype("float32", torch.device("cpu")) == torch.float32
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        memory.resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert memory.resolve_device("auto") == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert memory.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert memory.resolve_dtype("auto", torch.device("cuda")) == torch.float16
    assert memory.resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16


def test_cpu_flags_name_native_bf16(monkeypatch):
    from heron import cpu

    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    assert not cpu.has_native_bf16()
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert cpu.has_native_bf16()
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"amx_tile", "amx_bf16"}))
    assert cpu.has_native_bf16()


def test_cpu_budget_defaults_and_override():
    cpu = torch.device("cpu")
    assert memory.kv_cache_budget(EngineConfig(), cpu) == memory.cpu_default_kv_bytes()
    assert memory.kv_cache_budget(EngineConfig(kv_cache_memory="256MiB"), cpu) == 256 << 20


def test_cuda_budget_from_measured_free_memory():
    cfg = EngineConfig(gpu_memory_utilization=0.9)
    total, free = 80 * GiB, 70 * GiB  # 10 GiB already used by weights
    budget = memory.kv_cache_budget(cfg, torch.device("cuda"), activation_peak_bytes=2 * GiB,
                                    mem_get_info=lambda: (free, total))
    assert budget == int(0.9 * total) - 10 * GiB - 2 * GiB
    with pytest.raises(ConfigError, match="gpu-memory-utilization"):
        memory.kv_cache_budget(EngineConfig(gpu_memory_utilization=0.1), torch.device("cuda"),
                               mem_get_info=lambda: (free, total))


def test_num_blocks_fits_budget_and_caps_at_useful_size():
    cfg = EngineConfig(max_num_seqs=4, block_size=16)
    assert memory.num_kv_blocks(cfg, 100 * 1000, 1000, max_model_len=4096) == 100
    assert memory.num_kv_blocks(cfg, 10**12, 1000, max_model_len=64) == 4 * 4
    with pytest.raises(ConfigError, match="kv-cache-memory"):
        memory.num_kv_blocks(cfg, 10, 1000, max_model_len=64)
    assert memory.num_kv_blocks(EngineConfig(num_gpu_blocks_override=7), 10, 1000, 64) == 7


def test_cpu_default_kv_budget_is_a_tenth_of_memory_within_1_and_4_gib():
    gib = memory.GiB
    assert memory.cpu_default_kv_bytes(4 * gib) == gib
    assert memory.cpu_default_kv_bytes(24 * gib) == 2 * gib
    assert memory.cpu_default_kv_bytes(512 * gib) == 4 * gib
