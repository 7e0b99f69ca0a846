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
    """Resolve ``name`` as ``--model`` does (local dir, .gguf file, HF cache id, built-in model); any other local
    directory is taken as it is, since a tokenizer needs no weights."""
    from heron.errors import ModelLoadError
    from heron.model.loader import resolve_model

    try:
        source = resolve_model(name)
    except ModelLoadError as e:
        if Path(name).expanduser().is_dir():
            return ModelFiles(Path(name).expanduser())
        raise ConfigError(f"cannot find model files for {name!r} ({e}); use --tokenizer PATH when --model is "
                          "only the served name") from None
    if source.kind == "gguf":
        return ModelFiles(source.path.parent, source.path.name)
    return ModelFiles(source.path)


def load_tokenizer(name: str):
    """Load a transformers tokenizer for ``name`` (see ``resolve_model_files``)."""
    from transformers import AutoTokenizer

    files = resolve_model_files(name)
    return AutoTokenizer.from_pretrained(str(files.directory), **files.hf_kwargs())
