"""The packed integer weights gathered into one huge-page buffer at load: all of them, in module order, with the
same logits and tokens as weights left where they were packed."""

from __future__ import annotations

import sys

import gguf
import pytest
import torch

from heron import LLM, SamplingParams
from heron.model import weight_arena
from heron.quantization.packed_int import PackedInt
from tests.helpers import build_tiny_model, heron_logits, write_gguf

PROMPT = [5, 17, 42, 99, 7, 64, 3, 120, 33]


@pytest.fixture(scope="module")
def q4_path(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("arena")
    return write_gguf(build_tiny_model("llama", tmp / "llama"), tmp / "tiny.gguf", gguf.GGMLQuantizationType.Q4_1)


def make_llm(path) -> LLM:
    return LLM(model=str(path), max_model_len=128, enable_prefix_caching=False, seed=0)


def packed_layers(llm: LLM) -> list[PackedInt]:
    return [m.packed for m in llm.engine.core.runner.model.modules() if isinstance(getattr(m, "packed", None), PackedInt)]


def run(llm: LLM) -> tuple[torch.Tensor, list[int]]:
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    return heron_logits(llm, PROMPT), out[0].outputs[0].token_ids


@pytest.mark.skipif(sys.platform != "linux", reason="huge pages are asked of Linux")
def test_packed_weights_share_one_aligned_buffer_and_give_the_same_results(q4_path, monkeypatch):
    llm = make_llm(q4_path)
    packed = packed_layers(llm)
    assert len(packed) >= 9  # 2 layers x (qkv, o, gate_up, down) and the LM head
    tensors = [t for p in packed for t in (p.qweight, p.scales, p.mins)]
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(storages) == 1
    addresses = [t.data_ptr() for t in tensors]
    assert addresses == sorted(addresses)  # in module order: the order a forward reads them
    assert addresses[0] % weight_arena.HUGE_PAGE == 0
    gathered = run(llm)

    monkeypatch.setenv("HERON_WEIGHT_ARENA", "0")
    apart = make_llm(q4_path)
    assert len({p.qweight.untyped_storage().data_ptr() for p in packed_layers(apart)}) == len(packed)
    logits, tokens = run(apart)
    assert torch.equal(gathered[0], logits)
    assert gathered[1] == tokens


def test_weights_stay_where_huge_pages_are_refused(q4_path, monkeypatch):
    monkeypatch.setattr(weight_arena, "advise_huge_pages", lambda address, length: False)
    llm = make_llm(q4_path)
    packed = packed_layers(llm)
    assert len({p.qweight.untyped_storage().data_ptr() for p in packed}) == len(packed)
    assert len(run(llm)[1]) == 8


PEAK_SCRIPT = """
import resource, sys, torch
from heron.model.weight_arena import gather_packed_weights
from heron.quantization.packed_int import PackedInt

class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        q = torch.ones(2560, 1024, 16, 4, dtype=torch.uint8)  # 160 MiB of codes, touched
        s = torch.ones(2560, 16, 16, dtype=torch.float16)
        self.packed = PackedInt(q, s, s.clone(), 4, 32, 40960, 8192)

model = torch.nn.Sequential(*[Layer() for _ in range(4)])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
moved = gather_packed_weights(model)
print(moved, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="huge pages are asked of Linux")
def test_gathering_does_not_hold_a_second_copy_of_the_weights():
    # four layers of 160 MiB: moved one at a time, the peak grows by about one layer, not by the model
    import subprocess

    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, check=True)
    moved, growth_kib = (int(v) for v in out.stdout.split())
    assert moved > 4 * 160 * 2**20
    assert growth_kib * 1024 < 2 * 160 * 2**20
