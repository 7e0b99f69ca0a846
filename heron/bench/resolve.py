"""Find model files for the benchmark tools: a local HF directory, a .gguf file, or a built-in model name."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from heron.errors import ConfigError


@dataclass(frozen=True)
class ModelFiles:
    """Where a model's weights and tokenizer live: ``directory`` plus the GGUF file name inside it, if any."""

    directory: Path
    gguf_file: str | None = None

    @property
    def gguf_path(self) -> Path | None:
        """Full path of the GGUF file, or None for an HF directory."""
        return self.directory / self.gguf_file if self.gguf_file else None

    def hf_kwargs(self) -> dict:
        """Keyword arguments for ``from_pretrained`` beside the directory."""
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def resolve_model_files(name: str) -> ModelFiles:
    """Resolve ``name`` (local dir, .gguf file, or built-in model such as smollm2-135m-instruct) to files."""
    from heron.model.default_model import fetch_default_model, is_default_model

    if is_default_model(name):
        gguf = fetch_default_model(name)
        return ModelFiles(gguf.parent, gguf.name)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelFiles(path.parent, path.name)
    if path.is_dir():
        return ModelFiles(path)
    raise ConfigError(f"cannot find model files for {name!r}: pass a local HF directory, a .gguf file or a "
                      "built-in model name (use --tokenizer PATH when --model is only the served name)")


def load_tokenizer(name: str):
    """Load a transformers tokenizer for ``name`` (see ``resolve_model_files``)."""
    from transformers import AutoTokenizer

    files = resolve_model_files(name)
    return AutoTokenizer.from_pretrained(str(files.directory), **files.hf_kwargs())
