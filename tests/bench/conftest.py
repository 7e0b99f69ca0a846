"""Fixtures for the benchmark tests: a tiny word-level tokenizer and a tiny random-weight llama on disk."""

from __future__ import annotations

import pytest

from .fake_openai import FakeConfig, FakeOpenAIServer

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def make_tokenizer(vocab_words: int = 200):
    """A word-level tokenizer: tokens ``w0 .. w{n-1}`` plus [UNK], </s> and a few template words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "</s>", "user:", "assistant:"] + [f"w{i}" for i in range(vocab_words)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="session")
def tiny_llama_dir(tokenizer_dir):
    """A 2-layer random llama with the tiny tokenizer, saved as an HF directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = make_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(tokenizer_dir)
    return tokenizer_dir


@pytest.fixture
def fake_server(request):
    """A running fake server; parametrize indirectly with a FakeConfig to change timing or faults."""
    config = getattr(request, "param", None) or FakeConfig()
    with FakeOpenAIServer(config) as server:
        yield server
