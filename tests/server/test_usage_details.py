"""usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache served, as vLLM reports them
(`--enable-prompt-tokens-details`, always on in heron), from the core's count at a request's first schedule."""

from __future__ import annotations

import pytest

from heron import LLM, SamplingParams

from .conftest import ServerProcess

BLOCK_SIZE = 16
LONG = "Paged attention stores keys and values in fixed-size blocks of sixteen tokens. " * 4
ONE_TOKEN = {"model": "test-model", "max_tokens": 1, "temperature": 0}


def test_the_engine_reports_prefix_cache_hits_per_request(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), block_size=BLOCK_SIZE, dtype="float32")
    prompt = llm.get_tokenizer().encode(LONG)
    # max_tokens=1: the prompt's blocks are cached even when the request ends at its first token
    first, second = (llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)[0]
                     for _ in range(2))
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE > 0  # whole blocks only
    scored = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                          use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0  # prompt logprobs need every position computed: no lookup


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with ServerProcess(tiny_model_dir("llama"), "--enable-prompt-tokens-details", "--max-model-len", "256",
                        "--served-model-name", "test-model",
                        log_path=tmp_path_factory.mktemp("usage") / "server.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def test_completions_report_cached_tokens(server, client):
    prompt = "Completions. " + LONG  # a prefix of its own: no other test's blocks match it
    first = client.completions.create(prompt=prompt, **ONE_TOKEN)
    second = client.completions.create(prompt=prompt, **ONE_TOKEN)
    assert _cached(first.usage) == 0
    assert 0 < _cached(second.usage) < second.usage.prompt_tokens and _cached(second.usage) % BLOCK_SIZE == 0
    chunks = list(client.completions.create(prompt=prompt, stream=True,
                                            stream_options={"include_usage": True}, **ONE_TOKEN))
    assert _cached(chunks[-1].usage) == _cached(second.usage)


def test_chat_reports_cached_tokens(server, client):
    messages = [{"role": "user", "content": "Chat. " + LONG}]
    first = client.chat.completions.create(messages=messages, **ONE_TOKEN)
    chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **ONE_TOKEN))
    assert _cached(first.usage) == 0
    assert _cached(chunks[-1].usage) > 0 and _cached(chunks[-1].usage) % BLOCK_SIZE == 0
