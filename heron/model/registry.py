"""Maps a checkpoint's architecture name to heron's model class."""

from __future__ import annotations

from torch import nn

from heron.errors import ModelLoadError
from heron.model.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_class_for(config) -> type[nn.Module]:
    """The class implementing ``config.architectures[0]``, or a ModelLoadError naming the supported ones."""
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ModelLoadError(f"architecture {', '.join(archs) or '(none)'} is not supported; "
                         f"supported: {', '.join(MODEL_REGISTRY)}")
