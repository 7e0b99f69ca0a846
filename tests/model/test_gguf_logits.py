"""GGUF checkpoints through the whole engine: tiny models written as GGUF, and the real SmolLM2."""

from __future__ import annotations

import pytest
import torch
from helpers import heron_logits, write_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer

from heron import LLM, SamplingParams


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_gives_the_same_logits_as_safetensors(tiny_model_dir, tmp_path, arch):
    src = tiny_model_dir(arch)
    gguf_path = write_gguf(src, tmp_path / f"{arch}.gguf")
    prompt = list(range(3, 40))
    expected = heron_logits(LLM(str(src), dtype="float32"), prompt)
    torch.testing.assert_close(heron_logits(LLM(str(gguf_path), dtype="float32"), prompt), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.smollm2
def test_smollm2_greedy_chat_matches_transformers(smollm2_path):
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    llm = LLM(str(smollm2_path), dtype="float32", quantization="none")  # the dequantized weights transformers uses
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)[0]
    tok = AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                              dtype=torch.float32).eval()
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ref = hf.generate(ids["input_ids"], attention_mask=ids["attention_mask"], max_new_tokens=48,
                      do_sample=False)[0, ids["input_ids"].shape[1]:].tolist()
    assert out.prompt_token_ids == ids["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == ref
    assert len(ref) >= 32
    assert out.outputs[0].text.strip()
