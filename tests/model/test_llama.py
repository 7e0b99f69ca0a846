"""heron's Llama-family forward pass against transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
from helpers import heron_logits
from transformers import AutoModelForCausalLM

from heron import LLM, SamplingParams

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_greedy_match_transformers(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, block_size=8, dtype="float32")
    prompt = torch.randint(3, ref.config.vocab_size, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(heron_logits(llm, prompt), expected, atol=1e-4, rtol=1e-4)

    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=32,
                                                                    ignore_eos=True), use_tqdm=False)[0]
    hf = ref.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                      pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    assert out.outputs[0].token_ids == hf


def test_decode_logits_match_across_block_boundaries(tiny_model_dir):
    """Logits of each decode step (one query against paged context) equal a full forward's last row."""
    path = tiny_model_dir("qwen2")
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, block_size=4, dtype="float32")
    engine = llm.engine
    prompt = [5, 9, 11, 3, 7]
    engine.add_request("d", prompt, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True,
                                                   logprobs=0))
    while engine.has_unfinished_requests():
        out = engine.step()[0]
    toks = out.outputs[0].token_ids
    with torch.no_grad():
        full = torch.log_softmax(ref(torch.tensor([prompt + toks])).logits[0], dim=-1)
    expected = [full[len(prompt) - 1 + i, t].item() for i, t in enumerate(toks)]
    got = [d[t].logprob for t, d in zip(toks, out.outputs[0].logprobs, strict=True)]
    assert got == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize(("arch", "overrides"), [
    ("mistral", dict(sliding_window=8)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
])
def test_sliding_window_matches_transformers(tmp_path, arch, overrides):
    """A window much shorter than the context: prefill logits, then paged decode steps, equal transformers."""
    from helpers import build_tiny_model

    path = build_tiny_model(arch, tmp_path / arch, **overrides)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, block_size=4, max_num_batched_tokens=16, dtype="float32")  # chunked prefill crosses window edges too
    prompt = torch.randint(3, ref.config.vocab_size, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(heron_logits(llm, prompt), expected, atol=1e-4, rtol=1e-4)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                       use_tqdm=False)[0]
    hf = ref.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                      pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    assert out.outputs[0].token_ids == hf
