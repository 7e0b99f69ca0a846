"""Model resolution (local dirs, HF cache layout), the tokenizer-only load, and the errors a user sees for bad
models."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import write_gguf

import heron.model.gguf
from heron.errors import ModelLoadError
from heron.model.loader import load_tokenizer_only, resolve_model


def heron_cli(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, **(env_extra or {})}
    env.pop("HERON_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "heron", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in errors[0]


def test_resolves_hf_cache_layout(tiny_model_dir, tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "abc123"
    shutil.copytree(tiny_model_dir("llama"), snapshot)
    (tmp_path / "hub" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    source = resolve_model("acme/tiny")
    assert source.kind == "hf" and source.path == snapshot


def test_missing_model_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError, match="not found.*HF cache"):
        resolve_model("acme/absent")


def test_cli_missing_path(tmp_path):
    assert_one_line_error(heron_cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"), "not found")


def test_cli_corrupt_weights(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir("llama"), bad)
    for f in bad.glob("*.safetensors"):
        f.write_bytes(b"\x00garbage" * 10)
    assert_one_line_error(heron_cli("generate", "--model", str(bad), "--prompt", "hi"), "cannot read")


def test_cli_unsupported_architecture(tiny_model_dir, tmp_path):
    odd = tmp_path / "odd"
    shutil.copytree(tiny_model_dir("llama"), odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["architectures"] = ["FancyNetForCausalLM"]
    (odd / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(heron_cli("generate", "--model", str(odd), "--prompt", "hi"),
                          "FancyNetForCausalLM", "LlamaForCausalLM")


def test_cli_unknown_quantization_is_refused(tiny_model_dir):
    assert_one_line_error(heron_cli("generate", "--model", str(tiny_model_dir("llama")), "--prompt", "hi",
                                    "--quantization", "int3"), "quantization method 'int3' is not supported")


def test_cli_generate_streams_text(tiny_model_dir):
    proc = heron_cli("generate", "--model", str(tiny_model_dir("llama")), "--prompt", "t5 t6 t7",
                     "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


def test_not_a_gguf_file(tmp_path: Path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_model(str(f))


def test_tokenizer_only_reads_no_weights(tiny_model_dir, tmp_path, monkeypatch):
    def no_weights(*_):
        raise AssertionError("a tokenizer-only load touched the weights")

    monkeypatch.setattr(heron.model.gguf, "_dequantize", no_weights)
    monkeypatch.setattr("heron.model.loader._safetensors_weights", no_weights)
    model_dir = tiny_model_dir("llama")
    gguf_path = write_gguf(model_dir, tmp_path / "tiny.gguf")
    messages = [{"role": "user", "content": "Hello"}]
    for source in (model_dir, gguf_path):
        tok = load_tokenizer_only(str(source))
        assert tok.decode(tok.encode("Hello, world!")) == "Hello, world!"
        assert tok.apply_chat_template(messages, tokenize=False).startswith("<|im_start|>user\nHello")
    custom = load_tokenizer_only(str(gguf_path), chat_template="{{ messages[0]['content'] }}!")
    assert custom.apply_chat_template(messages, tokenize=False) == "Hello!"
