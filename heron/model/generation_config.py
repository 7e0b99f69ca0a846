"""The model's recommended sampling defaults: its ``generation_config.json`` (vLLM's ``--generation-config``).

``auto`` reads the file beside the model (an HF directory, its HF-cache snapshot, or the folder of a
``.gguf``); ``vllm`` ignores it; any other value names a folder holding one. The values found become the
defaults of the sampling fields a request leaves out; a request's own values always win.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from heron.errors import ConfigError, InvalidRequestError, ModelLoadError
from heron.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# the keys vLLM takes from a generation config, by their SamplingParams names (HF's max_new_tokens is max_tokens)
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def _folder(model: str, generation_config: str) -> Path | None:
    """The folder whose ``generation_config.json`` applies, or None (``vllm``, a built-in model, or a model
    that cannot be found: the engine reports that itself when it loads)."""
    if generation_config == "vllm":
        return None
    if generation_config != "auto":
        return Path(generation_config).expanduser()
    from heron.model.default_model import is_default_model
    from heron.model.loader import resolve_model

    if is_default_model(model):  # a GGUF fetched out of a wheel: nothing lies beside it
        return None
    try:
        source = resolve_model(model)
    except ModelLoadError:
        return None
    return source.path if source.kind == "hf" else source.path.parent


def default_sampling_params(model: str, generation_config: str = "auto") -> dict[str, Any]:
    """The sampling defaults ``generation_config`` gives for ``model``, by SamplingParams names; {} if none.

    Raises ConfigError if an explicit folder's file cannot be read or any file sets a value SamplingParams
    refuses (every request relying on it would fail). Logs the defaults found, once per call.
    """
    folder = _folder(model, generation_config)
    path = folder / GENERATION_CONFIG_FILE if folder is not None else None
    if path is None or not path.is_file():
        if generation_config not in ("auto", "vllm"):
            raise ConfigError(f"--generation-config {generation_config}: no {GENERATION_CONFIG_FILE} in that "
                              "folder; give auto, vllm or a folder holding one")
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}; fix it or pass --generation-config vllm") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not a JSON object; fix it or pass --generation-config vllm")
    defaults = {name: raw[key] for key, name in _KEYS.items() if raw.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except InvalidRequestError as e:
        raise ConfigError(f"{path} sets an invalid sampling default: {e}; fix it or pass "
                          "--generation-config vllm") from None
    if defaults:
        logger.info("Default sampling parameters from the model's generation config: %s", defaults)
    return defaults
