"""The Llama family: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm), on heron's shared layers."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from heron.attention.backend import AttentionMetadata
from heron.distributed.parallel_state import get_tp_group
from heron.errors import ConfigError
from heron.layers.activation import SiluAndMul
from heron.layers.attention import PagedAttention
from heron.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from heron.layers.linear import MergedLinear, RowParallelLinear
from heron.layers.norm import RMSNorm
from heron.layers.prompt_rows import kept_rows, step_rows
from heron.layers.rotary import RopeInputs, RotaryEmbedding
from heron.model.decoder_stack import DecoderStack
from heron.quantization import quantization_method_for


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config, layer_index: int) -> int | None:
    """The attention window of layer ``layer_index``: transformers' ``layer_types`` when the config has them
    (Qwen2 with ``use_sliding_window``), else Mistral's ``sliding_window`` on every layer."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_index] == "sliding_attention" else None
    return window if config.model_type == "mistral" else None


def check_tensor_parallel(config, size: int) -> None:
    """Refuse a tensor-parallel degree the model's shapes cannot split into: query heads and the MLP must divide
    evenly; KV heads too, or (fewer KV heads than ranks) be replicated, each on ``size / kv_heads`` ranks."""
    heads = config.num_attention_heads
    kv_heads = config.num_key_value_heads or heads
    problems = []
    if heads % size:
        problems.append(f"{heads} attention heads")
    if kv_heads % size and size % kv_heads:
        problems.append(f"{kv_heads} KV heads (they must divide by it, or it by them)")
    if config.intermediate_size % size:
        problems.append(f"an MLP of {config.intermediate_size}")
    if problems:
        raise ConfigError(f"--tensor-parallel-size {size} does not split this model: it has "
                          f"{' and '.join(problems)}; pick a size that divides its heads")


class Attention(nn.Module):
    """Self-attention; with tensor parallelism, this rank's query heads and their KV heads."""

    def __init__(self, config, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool,
                 sliding_window: int | None) -> None:
        super().__init__()
        tp = get_tp_group()
        total_heads = config.num_attention_heads
        total_kv_heads = config.num_key_value_heads or total_heads
        self.num_heads = total_heads // tp.size
        self.num_kv_heads = max(1, total_kv_heads // tp.size)  # fewer KV heads than ranks: replicated
        self.head_dim = head_dim_of(config)
        q_size, kv_size = total_heads * self.head_dim, total_kv_heads * self.head_dim
        kv_part = tp.part(min(total_kv_heads, tp.size))
        self.qkv_proj = MergedLinear(config.hidden_size, [q_size, kv_size, kv_size], bias=qkv_bias,
                                     quant_method=quantization_method_for(config, "qkv_proj"),
                                     output_parts=[tp.part(), kv_part, kv_part])
        o_bias = config.model_type != "qwen2" and bool(getattr(config, "attention_bias", False))
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias=o_bias,
                                        quant_method=quantization_method_for(config, "o_proj"))
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, sliding_window)

    def forward(self, rope: RopeInputs, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(rope, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedLinear(config.hidden_size, [config.intermediate_size] * 2, bias=bias,
                                         quant_method=quantization_method_for(config, "gate_up_proj"),
                                         output_parts=[get_tp_group().part()] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias,
                                           quant_method=quantization_method_for(config, "down_proj"))
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool,
                 sliding_window: int | None) -> None:
        super().__init__()
        self.self_attn = Attention(config, rotary, qkv_bias, qk_norm, sliding_window)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope: RopeInputs, hidden, residual, meta, keep: torch.Tensor | None = None):
        """(hidden, residual) after this layer; ``keep``: only those rows past the attention (see
        ``LlamaForCausalLM.forward``)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, meta)
        with kept_rows(keep, hidden.shape[0]):
            if keep is not None:
                hidden, residual = hidden[keep], residual[keep]
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer over a flattened token batch; ``compute_logits`` runs the LM head."""

    # checkpoint name -> (heron parameter name, shard of the merged weight)
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        check_tensor_parallel(config, get_tp_group().size)
        self.config = config
        model_type = config.model_type
        qkv_bias = model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        qk_norm = model_type == "qwen3"
        rotary = RotaryEmbedding(config, head_dim_of(config), max_positions)
        self.rotary = rotary
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, rotary, qkv_bias, qk_norm, sliding_window_of(config, i))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size,
                                      quant_method=quantization_method_for(config, "lm_head"))
        self.tie_weights()
        for p in self.parameters():
            p.requires_grad_(False)
        self.decoder_stack: DecoderStack | None = None  # see build_decoder_stack

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so (again after moving off meta)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def build_decoder_stack(self) -> None:
        """Once the weights are final (loaded and repacked): run the layers in one C++ call where this model
        and machine allow (heron/model/decoder_stack.py)."""
        self.decoder_stack = DecoderStack.build(self)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                layer_ids: list[int] | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states; ``layer_ids`` runs only those layers (then the final norm): a self-draft.
        ``keep`` (ascending row indices): only those rows' states, the others dropped after the last layer's
        attention, which has stored every row's keys and values (llama.cpp's output ids): a prompt chunk's rows
        before its last skip the last layer's MLP. Each kept row's result is the same bits as without ``keep``."""
        hidden = self.embed_tokens(input_ids)
        layer_ids = list(range(len(self.layers))) if layer_ids is None else list(layer_ids)
        stacked = None if self.decoder_stack is None else self.decoder_stack.forward(hidden, positions, meta,
                                                                                      layer_ids, keep)
        if stacked is None:
            residual = None
            rope = self.rotary.prepare(positions, hidden.dtype)
            with step_rows(meta.query_lens, meta.prompt_rows):
                for i in layer_ids:
                    hidden, residual = self.layers[i](rope, hidden, residual, meta,
                                                      keep if i == layer_ids[-1] else None)
        else:
            hidden, residual = stacked
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors, each into its heron parameter of the same name (a quantization method's
        ``weight_scale`` etc. included) in that parameter's dtype; returns the names of those filled."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            if "rotary_emb.inv_freq" in ckpt_name:
                continue
            name = ckpt_name.removeprefix("model.")
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            shard = None
            for packed, (merged, shard_id) in self.packed_modules.items():
                if f".{packed}." in name:
                    name, shard = name.replace(packed, merged), shard_id
                    break
            if name not in params:
                raise ValueError(f"unexpected tensor {ckpt_name} in checkpoint")
            owner = self.get_submodule(name.rsplit(".", 1)[0])
            loader = getattr(owner, "weight_loader", None)
            try:
                if loader is not None:
                    loader(params[name], tensor, shard)
                else:
                    params[name].data.copy_(tensor)
            except (ValueError, RuntimeError) as e:
                raise ValueError(f"{ckpt_name}: {e}") from None
            loaded.add(name)
        return loaded
