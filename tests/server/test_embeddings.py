"""/v1/embeddings and /pooling on a real server started with --runner pooling, driven with the official openai
client; vectors checked against transformers' hidden states."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from .conftest import ServerProcess

MODEL = "embed-model"
CHUNK = 16


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with ServerProcess(model_dir, "--runner", "pooling", "--dtype", "float32", "--pooler-config", '{"pooling_type": "MEAN"}',
                        "--max-model-len", "128", "--max-num-batched-tokens", str(CHUNK), "--served-model-name",
                        MODEL, log_path=tmp_path_factory.mktemp("embed-server") / "server.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@torch.no_grad()
def mean_reference(model_dir, texts: list[str]) -> list[np.ndarray]:
    """Normalized mean of transformers' last_hidden_state (after the final norm), one prompt at a time."""
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for text in texts:
        hidden = model(torch.tensor([tokenizer.encode(text)])).last_hidden_state[0]
        out.append(torch.nn.functional.normalize(hidden.mean(0), dim=-1).numpy())
    return out


TEXTS = ["The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away. Hello, world!", "Hi"]


def test_embeddings_equal_transformers_and_usage(server, client, model_dir):
    r = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert r.model == MODEL and [d.index for d in r.data] == [0, 1]
    counts = [httpx.post(server.url + "/tokenize", json={"prompt": t}).json()["count"] for t in TEXTS]
    assert counts[0] > 2 * CHUNK  # pooled over several prefill chunks
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(counts)
    for d, ref in zip(r.data, mean_reference(model_dir, TEXTS), strict=True):
        np.testing.assert_allclose(d.embedding, ref, atol=1e-5)
        assert abs(np.linalg.norm(d.embedding) - 1) < 1e-5


def test_base64_decodes_to_the_floats(server, client):
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    decoded = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    # separate requests may be batched differently (oneDNN's sums then differ in the last bits): a wrong encoding
    # (byte order, width) would be off by far more than 1e-6
    expected = np.array([d.embedding for d in floats.data])
    np.testing.assert_allclose([d.embedding for d in decoded.data], expected, rtol=0, atol=1e-6)
    raw = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"}).json()
    vectors = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]]
    np.testing.assert_allclose(vectors, expected, rtol=0, atol=1e-6)


def test_token_ids_alone_and_batched_equal_text(server, client):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": TEXTS[0]}).json()["tokens"]
    by_text = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float").data[0].embedding
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float").data[0].embedding
    batch = client.embeddings.create(model=MODEL, input=[[5, 6, 7], ids, list(range(3, 90))],
                                     encoding_format="float")
    assert by_ids == by_text
    np.testing.assert_allclose(batch.data[1].embedding, by_text, atol=1e-5)


def test_pooling_endpoint_returns_the_same_vectors(server, client):
    r = httpx.post(server.url + "/pooling", json={"model": MODEL, "input": TEXTS}).json()
    assert r["object"] == "list" and [d["object"] for d in r["data"]] == ["pooling", "pooling"]
    embedded = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    np.testing.assert_allclose([d["data"] for d in r["data"]], [d.embedding for d in embedded.data], atol=1e-6)


BAD_INPUTS = [
    ({"input": ""}, "input", "must not be empty"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": ["ok", ""]}, "input", "must not be empty"),
    ({"input": [[1, 2], []]}, "input", "must not be empty"),
    ({"input": list(range(3, 200))}, "input", "maximum context length is 128 tokens, but the input has 197"),
    ({"input": [5, 100000]}, "input", "token ids must be in"),
    ({"input": "x" * 100_000}, "prompt", "maximum context length"),
    ({"input": "hi", "dimensions": 8}, "dimensions", "matryoshka"),
    ({"input": "hi", "encoding_format": "binary"}, "encoding_format", "float"),
    ({"input": 7}, "input", "expected"),
]


@pytest.mark.parametrize("body, param, needle", BAD_INPUTS)
def test_bad_inputs_are_openai_400s(server, body, param, needle):
    r = httpx.post(server.url + "/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert needle in error["message"]


def test_generation_routes_are_refused_and_the_server_keeps_serving(server, client):
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client.completions.create(model=MODEL, prompt="hi")
    with pytest.raises(openai.BadRequestError, match="matryoshka"):
        client.embeddings.create(model=MODEL, input="hi", dimensions=8)
    assert len(client.embeddings.create(model=MODEL, input="still alive").data[0].embedding) == 64
    assert httpx.get(server.url + "/health").status_code == 200
