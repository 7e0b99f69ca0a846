"""Sampling defaults from the model's generation_config.json (`--generation-config auto|vllm|PATH`): read where
vLLM reads them, applied only to the fields a request leaves out, on LLM and on the server's two routes."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from heron import LLM, SamplingParams
from heron.errors import ConfigError
from heron.model.generation_config import default_sampling_params
from heron.server.protocol import ChatCompletionRequest, CompletionRequest

from .conftest import ServerProcess

# the model's recommendation: greedy, 5 new tokens
GENERATION_CONFIG = {"temperature": 0.0, "max_new_tokens": 5, "do_sample": False, "bos_token_id": 1}
DEFAULTS = {"temperature": 0.0, "max_tokens": 5}
IGNORE_EOS = {"extra_body": {"ignore_eos": True}}  # the random model may end early otherwise


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny llama with a generation_config.json that recommends greedy sampling and 5 new tokens."""
    path = shutil.copytree(tiny_model_dir("llama"), tmp_path_factory.mktemp("gencfg") / "model")
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return path


def test_auto_reads_the_sampling_keys_beside_the_model(tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": None, "repetition_penalty": 1.1,
         "max_new_tokens": 64, "do_sample": True, "eos_token_id": [2, 3]}))
    (tmp_path / "model.gguf").write_bytes(b"")  # a GGUF is looked up beside it: the file is not read
    with caplog.at_level(logging.INFO, logger="heron.model.generation_config"):
        defaults = default_sampling_params(str(tmp_path / "model.gguf"))
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 64}
    assert "Default sampling parameters from the model's generation config: {'temperature': 0.6" in caplog.text
    assert default_sampling_params(str(tmp_path / "model.gguf"), "vllm") == {}
    assert default_sampling_params("smollm2-135m-instruct") == {}  # built in: nothing beside it, nothing fetched


def test_absence_is_quiet_and_a_bad_setting_fails_clearly(tiny_model_dir, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="heron.model.generation_config"):
        assert default_sampling_params(str(tiny_model_dir("llama"))) == {}  # one without sampling keys
        assert default_sampling_params(str(tmp_path / "lonely.gguf")) == {}  # no such model: the engine says so
    assert caplog.text == ""
    with pytest.raises(ConfigError, match="--generation-config .*no generation_config.json"):
        default_sampling_params("any", str(tmp_path))
    (tmp_path / "generation_config.json").write_text('{"top_p": 0}')
    with pytest.raises(ConfigError, match="invalid sampling default: top_p"):
        default_sampling_params("any", str(tmp_path))


def test_requests_keep_what_they_set_and_take_defaults_for_the_rest():
    silent = CompletionRequest(prompt="x").to_sampling_params(DEFAULTS)
    assert (silent.temperature, silent.max_tokens, silent.top_p) == (0.0, 5, 1.0)
    explicit = CompletionRequest(prompt="x", temperature=0.7, max_tokens=9).to_sampling_params(DEFAULTS)
    assert (explicit.temperature, explicit.max_tokens) == (0.7, 9)
    null = CompletionRequest(prompt="x", temperature=None).to_sampling_params(DEFAULTS)
    assert null.temperature == 0.0  # null is silence, as in vLLM
    assert CompletionRequest(prompt="x").to_sampling_params().max_tokens == 16  # OpenAI's default otherwise
    chat = [{"role": "user", "content": "hi"}]
    assert ChatCompletionRequest(messages=chat).to_sampling_params(DEFAULTS).max_tokens == 5
    assert ChatCompletionRequest(messages=chat, max_completion_tokens=7).to_sampling_params(DEFAULTS).max_tokens == 7
    assert ChatCompletionRequest(messages=chat).to_sampling_params().max_tokens is None


def test_llm_default_sampling_params(model_dir):
    llm = LLM(str(model_dir), dtype="float32")
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
    out = llm.generate("The quick brown fox", use_tqdm=False)[0].outputs[0]
    greedy = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert out.token_ids == greedy[0].outputs[0].token_ids
    assert LLM(str(model_dir), dtype="float32", generation_config="vllm").get_default_sampling_params() == \
        SamplingParams()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with ServerProcess(model_dir, "--max-model-len", "256", log_path=tmp_path_factory.mktemp("gencfg") / "log") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_server_applies_the_defaults_where_the_request_is_silent(server, client, model_dir):
    model, prompt = str(model_dir), "Once upon a time"
    silent = client.completions.create(model=model, prompt=prompt, **IGNORE_EOS)
    assert silent.usage.completion_tokens == 5
    greedy = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=5, **IGNORE_EOS)
    assert silent.choices[0].text == greedy.choices[0].text  # temperature 0 came from the model
    explicit = client.completions.create(model=model, prompt=prompt, max_tokens=9, **IGNORE_EOS)
    assert explicit.usage.completion_tokens == 9
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], **IGNORE_EOS)
    assert chat.usage.completion_tokens == 5
    assert "Default sampling parameters from the model's generation config: " \
           "{'temperature': 0.0, 'max_tokens': 5}" in server.log()


def test_a_bad_generation_config_folder_stops_the_server_at_start(launch_server, model_dir, tmp_path):
    proc = launch_server(model_dir, "--generation-config", str(tmp_path))
    assert proc.proc.wait(120) == 1
    assert f"error: --generation-config {tmp_path}: no generation_config.json in that folder" in proc.log()
