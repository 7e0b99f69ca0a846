"""Tokenizer loading and chat templates, via transformers."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from heron.errors import ModelLoadError


def load_tokenizer(path: str | Path, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """Load an HF tokenizer from a local directory; ``chat_template`` (text or a file) overrides the model's."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {e}") from None
    return set_chat_template(tokenizer, chat_template)


def set_chat_template(tokenizer: PreTrainedTokenizerBase, template: str | None) -> PreTrainedTokenizerBase:
    """Install ``template`` (Jinja text, or the path of a file holding it) when given."""
    if template:
        path = Path(template).expanduser()
        tokenizer.chat_template = path.read_text() if path.is_file() else template
    return tokenizer


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, *configs) -> set[int]:
    """All ids that end generation: the tokenizer's eos plus each config's (which may be a list)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    for config in configs:
        eos = getattr(config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids
