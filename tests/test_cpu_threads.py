"""How many intra-op threads the engine core takes."""

from __future__ import annotations

import pytest
import torch

from heron import cpu
from heron.config import EngineConfig
from heron.errors import ConfigError


@pytest.mark.parametrize(("cores", "serving", "expected"), [(2, True, 2), (2, False, 2), (4, True, 3),
                                                             (16, True, 15), (16, False, 16), (1, True, 1)])
def test_default_threads_leave_a_core_to_the_api_process_from_four_cores(monkeypatch, cores, serving, expected):
    monkeypatch.delenv("HERON_CPU_THREADS", raising=False)
    monkeypatch.setattr(cpu, "usable_cores", lambda: cores)
    monkeypatch.setattr(cpu, "torch_default_threads", lambda: cores)
    assert cpu.engine_threads(None, serving) == expected


def test_default_threads_stay_within_torchs_default_and_the_affinity_mask(monkeypatch):
    monkeypatch.delenv("HERON_CPU_THREADS", raising=False)
    monkeypatch.setattr(cpu, "usable_cores", lambda: 32)  # 16 cores with two hyperthreads each
    monkeypatch.setattr(cpu, "torch_default_threads", lambda: 16)
    assert cpu.engine_threads(None, serving=False) == 16
    monkeypatch.setattr(cpu, "usable_cores", lambda: 4)  # taskset to 4 CPUs
    assert cpu.engine_threads(None, serving=False) == 4


def test_flag_then_environment_override_the_default(monkeypatch):
    monkeypatch.setattr(cpu, "usable_cores", lambda: 16)
    monkeypatch.setenv("HERON_CPU_THREADS", "5")
    assert cpu.engine_threads(None, serving=True) == 5
    assert cpu.engine_threads(7, serving=True) == 7
    monkeypatch.setenv("HERON_CPU_THREADS", "0")
    with pytest.raises(ValueError, match="at least 1"):
        cpu.engine_threads(None, serving=True)


def test_set_engine_threads_sets_torchs_pool(monkeypatch):
    before = torch.get_num_threads()
    try:
        assert cpu.set_engine_threads(1, serving=False) == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_cpu_threads_below_one_is_refused_at_start():
    with pytest.raises(ConfigError, match="--cpu-threads"):
        EngineConfig(model="x", cpu_threads=0).validate()
