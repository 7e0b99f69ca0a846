"""Finds a model (local dir, HF cache, GGUF file, built-in default) and loads it into heron's model classes."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from heron.errors import ModelLoadError
from heron.layers.linear import LinearBase
from heron.model.registry import model_class_for
from heron.model.tokenizer import eos_token_ids, load_tokenizer, set_chat_template
from heron.model.weight_arena import gather_packed_weights
from heron.quantization import get_quantization_method

logger = logging.getLogger(__name__)


@dataclass
class ModelSource:
    """Where a model lives: ``kind`` is "hf" (a directory with config.json) or "gguf" (a file)."""

    kind: str
    path: Path


@dataclass
class LoadedModel:
    model: torch.nn.Module
    hf_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: set[int]
    source: ModelSource
    load_seconds: float


def hf_hub_cache() -> Path:
    """The HF hub cache directory, honouring HF_HUB_CACHE and HF_HOME as huggingface_hub does."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    return Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser() / "hub"


def _from_hf_cache(repo_id: str) -> Path | None:
    repo = hf_hub_cache() / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file() and (snapshots / ref.read_text().strip()).is_dir():
        return snapshots / ref.read_text().strip()
    candidates = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    return candidates[0] if candidates else None


def resolve_model(name: str) -> ModelSource:
    """Turn ``--model`` into a local source, without touching the network."""
    from heron.model.default_model import fetch_default_model, is_default_model

    if is_default_model(name):
        return ModelSource("gguf", fetch_default_model(name))
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; pass a GGUF file or a model directory")
        return ModelSource("gguf", path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("hf", path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0])
        raise ModelLoadError(f"{path} has no config.json and {len(ggufs)} .gguf files; cannot tell what to load")
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        snapshot = _from_hf_cache(name)
        if snapshot is not None:
            return resolve_model(str(snapshot))
    raise ModelLoadError(
        f"model {name!r} not found: not a local path, not in the HF cache ({hf_hub_cache()}), and not a "
        f"built-in model (smollm2-135m-instruct). heron never downloads from a hub; fetch it first, "
        f"e.g. `huggingface-cli download {name}`")


def load_tokenizer_only(name: str, tokenizer: str | None = None, chat_template: str | None = None
                        ) -> PreTrainedTokenizerBase:
    """The tokenizer (and chat template) of model ``name``, or of ``tokenizer`` if given; reads no weights."""
    if tokenizer:
        return load_tokenizer(tokenizer, chat_template)
    source = resolve_model(name)
    if source.kind == "gguf":
        from heron.model.gguf import gguf_tokenizer

        return set_chat_template(gguf_tokenizer(source.path), chat_template)
    return load_tokenizer(source.path, chat_template)


def _safetensors_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} holds no *.safetensors weights")
    for file in tqdm(files, desc="Loading safetensors", disable=len(files) < 2):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"cannot read {file}: {e}") from None


def _hf_config(path: Path) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {e}") from None


def _generation_config(path: Path) -> GenerationConfig | None:
    if not (path / "generation_config.json").is_file():
        return None
    try:
        return GenerationConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError):
        return None


def load_model(name: str, dtype: torch.dtype, device: torch.device, max_positions: int | None = None,
               tokenizer: str | None = None, chat_template: str | None = None,
               quantization: str | None = None) -> LoadedModel:
    """Load weights, config and tokenizer of ``name`` onto ``device`` in ``dtype``.

    ``quantization`` names the linear layers' method (heron.quantization); None: the checkpoint's own
    ``quantization_config``, else unquantized. Parameters a method creates in another dtype keep it.
    """
    start = time.perf_counter()
    source = resolve_model(name)
    generation_config = None
    if source.kind == "gguf":
        from heron.model.gguf import load_gguf

        quantization = _gguf_quantization(quantization, device)
        ckpt = load_gguf(source.path, dtype, keep_quantized=quantization == "gguf")
        hf_config, weights, tok = ckpt.config, iter(ckpt.state_dict.items()), ckpt.tokenizer
    else:
        if quantization == "gguf":
            raise ModelLoadError(f"--quantization gguf applies to GGUF files; {source.path} is a model directory")
        hf_config = _hf_config(source.path)
        generation_config = _generation_config(source.path)
        weights, tok = _safetensors_weights(source.path), None
    model_cls = model_class_for(hf_config)
    _set_quantization(hf_config, quantization)
    max_positions = max_positions or getattr(hf_config, "max_position_embeddings", 4096)
    with torch.device("meta"), _default_dtype(dtype):
        model = model_cls(hf_config, max_positions)
    model = model.to_empty(device=device)
    model.tie_weights()
    _init_buffers(model, hf_config, max_positions, device)
    try:
        loaded = model.load_weights(weights)
    except ValueError as e:
        raise ModelLoadError(f"weights of {source.path} do not fit {hf_config.architectures[0]}: {e}") from None
    missing = {n for n, _ in model.named_parameters()} - loaded
    if missing:
        raise ModelLoadError(f"checkpoint {source.path} lacks weights: {', '.join(sorted(missing)[:5])}")
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.quant_method.process_weights_after_loading(module)
    gather_packed_weights(model)
    model.build_decoder_stack()
    model.eval()
    if tok is None:
        tok = load_tokenizer(tokenizer or source.path, chat_template)
    else:
        tok = load_tokenizer(tokenizer, chat_template) if tokenizer else set_chat_template(tok, chat_template)
    eos = eos_token_ids(tok, hf_config, generation_config)
    seconds = time.perf_counter() - start
    logger.info("loaded %s (%s) in %.2fs", source.path, hf_config.architectures[0], seconds)
    return LoadedModel(model, hf_config, tok, eos, source, seconds)


def _gguf_quantization(quantization: str | None, device: torch.device) -> str | None:
    """A GGUF's blocks stay quantized by default on the CPU (heron's integer kernel reads them); on other
    devices, and with ``--quantization none``, the file is dequantized at load (or requantized by another
    method)."""
    if quantization is None and device.type == "cpu":
        return "gguf"
    return None if quantization == "none" else quantization


def _set_quantization(hf_config, quantization: str | None) -> None:
    """Put the requested method into ``hf_config.quantization_config``, where the model's layers look it up;
    refuse one that contradicts the checkpoint's or that heron does not know."""
    quant_config = getattr(hf_config, "quantization_config", None) or {}
    stored = quant_config.get("quant_method")
    if quantization is not None and quantization != stored:
        if stored is not None:
            raise ModelLoadError(f"the checkpoint is quantized with {stored!r}; it cannot be loaded as "
                                 f"{quantization!r} (drop --quantization)")
        hf_config.quantization_config = {**quant_config, "quant_method": quantization}
    get_quantization_method(quantization or stored)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created without an explicit dtype get ``dtype``; those a quantization method sets keep theirs."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _init_buffers(model: torch.nn.Module, hf_config, max_positions: int, device: torch.device) -> None:
    """Buffers (rotary tables) are not in checkpoints: rebuild them, since to_empty left them uninitialised."""
    from heron.layers.rotary import RotaryEmbedding

    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            fresh = RotaryEmbedding(hf_config, module.cos.shape[-1], max_positions)
            module.cos, module.sin = fresh.cos.to(device), fresh.sin.to(device)
