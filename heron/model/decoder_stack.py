"""A Llama-family model's decoder layers run in one C++ call (heron/kernels/csrc/decoder_stack.cpp).

On the CPU a decoder layer's per-op form is a dozen Python and pybind calls around its kernels; at one sequence
that dispatch cost about as much as the layer's arithmetic (docs/performance.md). The stack runs the same
kernels in the same order on tensors of the same shapes and strides, so its output is the per-op form's bit
for bit, and the per-op form stays the definition (and the path of everything the stack does not cover).

The model builds a stack once loaded (``LlamaForCausalLM.build_decoder_stack``) when:
- heron's CPU kernels are available and the model is on the CPU, on one tensor-parallel rank;
- its layers have no q/k norms (Qwen3 takes the per-op form);
- every linear layer's quantization method can hand its matmul to the stack (``stack_linear``: packed integer
  weights, and dense ones with or without a oneDNN copy).
A step then goes through it when every attention layer attends through the CPU paged kernel for every query
(the cpu_paged backend, with its float8 scales already set) and in the model's dtype, and, where integer layers
keep a copy for prompt tokens (heron/quantization/packed_int.py), when it holds no prompt tokens. ``HERON_DECODER_STACK=0``
turns it off, to compare against the per-op form.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from heron.attention.backend import AttentionMetadata
from heron.attention.cpu_paged import CpuPagedBackend
from heron.distributed.parallel_state import get_tp_group
from heron.kernels import kernels_for

if TYPE_CHECKING:
    from heron.model.llama import LlamaForCausalLM


class DecoderStack:
    """The compiled stack of one model, with the attention layers whose pools and scales each step passes."""

    def __init__(self, stack, model: LlamaForCausalLM) -> None:
        self.stack = stack
        self.attention = model.attention_layers()
        self.dtype = model.embed_tokens.weight.dtype
        self.prompt_weights = any(getattr(m, "prompt_weight", None) is not None for m in model.layers.modules())

    @classmethod
    def build(cls, model: LlamaForCausalLM) -> DecoderStack | None:
        """``model``'s stack, or None where it cannot have one (see the module docstring)."""
        kernels = kernels_for(model.embed_tokens.weight)
        if kernels is None or os.environ.get("HERON_DECODER_STACK", "1") == "0" or get_tp_group().size != 1:
            return None
        dtype = model.embed_tokens.weight.dtype
        layers = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.q_norm is not None:
                return None
            linears = [lin.quant_method.stack_linear(lin, kernels)
                       for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(linear is None for linear in linears):
                return None
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(norm.weight.dtype != dtype for norm in norms):
                return None
            layers.append(kernels.StackLayer(norms[0].weight, norms[0].eps, norms[1].weight, norms[1].eps,
                                             *linears, attn.attn.sliding_window or 0))
        first = model.layers[0].self_attn
        stack = kernels.DecoderStack(layers, first.num_heads, first.num_kv_heads, first.head_dim,
                                     model.rotary.cos, model.rotary.sin)
        return cls(stack, model)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                layer_ids: list[int], keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layers ``layer_ids`` over the embeddings ``hidden``: (hidden, residual) before the final norm, as the
        per-op layers give them (only rows ``keep`` past the last layer's attention, if given); None when this
        step cannot go through the stack."""
        ranges = CpuPagedBackend.kernel_queries(meta, hidden.dtype)
        if (ranges is None or hidden.dtype != self.dtype or not hidden.is_contiguous()
                or self.prompt_weights and any(meta.prompt_rows)):
            return None
        caches, k_scales, v_scales = [], [], []
        for attn in self.attention:
            backend = attn.backend
            if type(backend) is not CpuPagedBackend or backend.calculate_kv_scales or attn.kv_cache is None:
                return None
            caches.append(attn.kv_cache)
            k_scales.append(backend.kv_scales.k)
            v_scales.append(backend.kv_scales.v)
        begin, end = ranges
        return self.stack.forward(hidden, positions, caches, k_scales, v_scales, meta.block_table, meta.seq_lens,
                                  begin, end, meta.slot_mapping, layer_ids, keep)
