"""Rows whose outputs nobody wants stop after the last layer's attention (``LlamaForCausalLM.forward``'s ``keep``,
llama.cpp's output ids): the wanted rows' tokens and logprobs are the same bits as when every row runs to the
end, through the per-op layers and the decoder stack, dense and integer weights, prompt copies included; and the
last layer's MLP sees only the wanted rows."""

from __future__ import annotations

import pytest
from helpers import assert_no_leaks, build_tiny_model

from heron import LLM, SamplingParams
from heron.model.llama import LlamaForCausalLM

# a prompt longer than the step budget below (chunks with no wanted row), and short ones beside it
PROMPTS = [list(range(3, 40)), [5, 9, 17, 33, 60, 2, 100, 7], [11, 12, 13]]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def make_llm(path, **kwargs) -> LLM:
    return LLM(model=str(path), max_model_len=256, max_num_seqs=8, block_size=16, seed=0,
               enable_prefix_caching=False, **kwargs)


def generate(llm: LLM, max_tokens: int = 6) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in outs]


def every_row_to_the_end(monkeypatch) -> None:
    """The model as before ``keep``: every row through every layer, the wanted ones picked afterwards."""
    original = LlamaForCausalLM.forward

    def forward(self, input_ids, positions, meta, layer_ids=None, keep=None):
        hidden = original(self, input_ids, positions, meta, layer_ids)
        return hidden if keep is None else hidden[keep]

    monkeypatch.setattr(LlamaForCausalLM, "forward", forward)


@pytest.mark.parametrize("stack", [True, False], ids=["stack", "per-op"])
@pytest.mark.parametrize("kwargs", [{"dtype": "float32", "quantization": "int4"},
                                    {"dtype": "bfloat16", "quantization": "int4"}, {"dtype": "bfloat16"},
                                    {"dtype": "float32"}],
                         ids=["int4", "bfloat16-int4", "bfloat16", "float32"])
def test_wanted_rows_get_the_same_tokens_and_logprobs(llama_dir, monkeypatch, kwargs, stack):
    if not stack:
        monkeypatch.setenv("HERON_DECODER_STACK", "0")
    # a 16-token budget: the long prompt in chunks, some steps with no wanted row, others mixing decodes and
    # prompt chunks (so the kept rows hold prompt and generated rows, each taking its own kernel)
    llm = make_llm(llama_dir, max_num_batched_tokens=16, **kwargs)
    kept = generate(llm)
    assert_no_leaks(llm)
    every_row_to_the_end(monkeypatch)
    every_row = generate(llm)
    if kwargs == {"dtype": "float32"}:
        # dense float32 weights take torch's matmul, whose blocking (so a row's last bits) follows the row count
        assert [tokens for tokens, _ in every_row] == [tokens for tokens, _ in kept]
        for (_, got), (_, want) in zip(every_row, kept, strict=True):
            for got_step, want_step in zip(got, want, strict=True):
                assert got_step.keys() == want_step.keys()
                assert [got_step[t] for t in want_step] == pytest.approx(list(want_step.values()), abs=1e-5)
    else:  # heron's kernels compute each row alone
        assert every_row == kept


def test_the_last_layers_mlp_sees_only_the_wanted_rows(llama_dir, monkeypatch):
    monkeypatch.setenv("HERON_DECODER_STACK", "0")  # the per-op layers, whose modules a hook can watch
    llm = make_llm(llama_dir)
    layers = llm.engine.core.runner.model.layers
    rows: dict[str, list[int]] = {"first": [], "last": []}
    layers[0].mlp.register_forward_pre_hook(lambda module, args: rows["first"].append(args[0].shape[0]))
    layers[-1].mlp.register_forward_pre_hook(lambda module, args: rows["last"].append(args[0].shape[0]))
    generate(llm, max_tokens=2)
    prompt_tokens = sum(len(p) for p in PROMPTS)
    # one step of all prompts (one wanted row each), then one decode step of the three
    assert rows == {"first": [prompt_tokens, 3], "last": [3, 3]}
