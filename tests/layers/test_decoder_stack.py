"""The one-call decoder stack (heron/model/decoder_stack.py) against the per-op layers it replaces: the same
logits bit for bit, the same greedy tokens and logprobs, and the per-op form wherever the stack does not apply."""

from __future__ import annotations

import gguf
import pytest
import torch
from helpers import build_tiny_model, heron_logits, write_gguf

from heron import LLM, SamplingParams
from heron.cpu import has_native_bf16
from heron.kernels import cpu_kernels
from heron.model.llama import DecoderLayer

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="heron's CPU kernels cannot be built here")

PROMPTS = [[5, 9, 17, 33, 60, 2, 100, 7], [11, 12, 13], list(range(40, 75))]


def make_llm(path, **kwargs) -> LLM:
    # no prefix cache: a second run would compute fewer positions of each prompt, and in half precision a long
    # prefill chunk takes SDPA where a short one takes the kernel (another last bit, another path to compare)
    return LLM(model=str(path), max_model_len=256, max_num_seqs=8, block_size=16, seed=0,
               enable_prefix_caching=False, **kwargs)


def stack_of(llm: LLM):
    return llm.engine.core.runner.model.decoder_stack


def per_op(llm: LLM, run):
    """``run()`` with the model's layers in their per-op form."""
    model = llm.engine.core.runner.model
    stack, model.decoder_stack = model.decoder_stack, None
    try:
        return run()
    finally:
        model.decoder_stack = stack


def generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                      o.outputs[0].token_ids, strict=True)])
            for o in outs]


def assert_stack_equals_per_op(llm: LLM) -> None:
    assert stack_of(llm) is not None
    for prompt in PROMPTS:
        torch.testing.assert_close(heron_logits(llm, prompt), per_op(llm, lambda p=prompt: heron_logits(llm, p)),
                                   atol=0, rtol=0)
    assert generate(llm) == per_op(llm, lambda: generate(llm))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize("kwargs", [{}, {"dtype": "bfloat16"}, {"quantization": "int8"}, {"quantization": "int4"},
                                    {"kv_cache_dtype": "fp8", "calculate_kv_scales": True}],
                         ids=["float32", "bfloat16", "int8", "int4", "fp8-kv"])
def test_stack_gives_the_per_op_logits_and_tokens(llama_dir, kwargs):
    llm = make_llm(llama_dir, **kwargs)
    if kwargs.get("dtype") == "bfloat16" and has_native_bf16():
        # the stack calls the weights' packed copies (an 8-token prompt is more rows than the gemv takes)
        assert llm.engine.core.runner.model.layers[0].mlp.down_proj.batch_weight is not None
    assert_stack_equals_per_op(llm)


@pytest.mark.parametrize("arch,overrides", [("qwen2", {}), ("mistral", {"sliding_window": 8})])
def test_stack_covers_biases_and_sliding_windows(tmp_path, arch, overrides):
    assert_stack_equals_per_op(make_llm(build_tiny_model(arch, tmp_path / arch, **overrides)))


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.F16])
def test_stack_runs_gguf_weights_packed_and_dense(llama_dir, tmp_path, qtype):
    path = write_gguf(llama_dir, tmp_path / "tiny.gguf", qtype)
    assert_stack_equals_per_op(make_llm(path))


def test_steps_the_stack_does_not_cover_take_the_per_op_layers(llama_dir, tmp_path, monkeypatch):
    """Qwen3's q/k norms, the reference backend and ``HERON_DECODER_STACK=0`` leave the per-op form; with the
    stack in place, no decode step calls a per-op layer."""
    calls = []
    original = DecoderLayer.forward
    monkeypatch.setattr(DecoderLayer, "forward", lambda self, *a: calls.append(1) or original(self, *a))
    llm = make_llm(llama_dir, dtype="float32")  # every query through the kernel (half precision: long chunks not)
    generate(llm)
    assert not calls
    assert stack_of(make_llm(build_tiny_model("qwen3", tmp_path / "qwen3"))) is None
    reference = make_llm(llama_dir, dtype="float32", attention_backend="reference")
    generate(reference)
    assert calls
    monkeypatch.setenv("HERON_DECODER_STACK", "0")
    assert stack_of(make_llm(llama_dir)) is None
