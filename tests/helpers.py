"""Tiny random-weight models for tests and benchmarks: HF directories that load offline, and GGUF copies.

Import it as ``from helpers import build_tiny_model`` in tests (tests/ is on sys.path through conftest.py);
a benchmark script adds the tests folder to ``sys.path`` first.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

TINY_ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
_ARCH_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# the default varies so that both tied and untied output heads are exercised
_DEFAULT_TIE = {"llama": True, "mistral": False, "qwen2": False, "qwen3": True}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "Hello, world! How are you today? I am fine, thank you, and you?",
    "Paged attention stores keys and values in fixed-size blocks of sixteen tokens.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))  # 3",
    "Once upon a time there was a little heron that lived by a quiet river.",
    '{"name": "heron", "numbers": [1, 2, 3, 42, 100], "ok": true}',
]


def build_tiny_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a few sentences, ChatML-style specials and chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


def tiny_config(arch: str, vocab_size: int, tie_word_embeddings: bool | None = None, **overrides):
    """A 2-layer, hidden-64 transformers config of ``arch`` (one of TINY_ARCHS)."""
    kwargs = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, architectures=[_ARCH_CLASSES[arch]], dtype="float32",
        tie_word_embeddings=_DEFAULT_TIE[arch] if tie_word_embeddings is None else tie_word_embeddings,
    )
    if arch == "mistral":
        kwargs["sliding_window"] = None
    return AutoConfig.for_model(arch, **{**kwargs, **overrides})


def build_tiny_model(arch: str, path: str | Path, tie_word_embeddings: bool | None = None, seed: int = 0,
                     **overrides) -> Path:
    """Save a random-weight ``arch`` model (safetensors) and the tiny tokenizer into ``path``; return it.

    Norm weights and biases are randomized too, so a loader that drops or mixes them up changes the logits.
    """
    path = Path(path)
    tokenizer = build_tiny_tokenizer()
    config = tiny_config(arch, overrides.pop("vocab_size", len(tokenizer)), tie_word_embeddings, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_gguf(model_dir: str | Path, path: str | Path, qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
               architecture: str | None = None, extra_tensors: dict[str, np.ndarray] | None = None) -> Path:
    """Convert a tiny model directory to GGUF the way llama.cpp does; 2-D weights stored as ``qtype``.

    ``architecture`` overrides general.architecture (to write files heron must refuse); ``extra_tensors``
    are added as F32/raw (e.g. ``rope_freqs.weight``).
    """
    model_dir, path = Path(model_dir), Path(path)
    config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    state_dict = load_file(model_dir / "model.safetensors")
    source_arch = "llama" if config.model_type == "mistral" else config.model_type
    writer = gguf.GGUFWriter(path, architecture or source_arch)
    writer.add_name(f"tiny-{config.model_type}")
    _add_hparams(writer, config)
    _add_tokenizer(writer, tokenizer)
    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == source_arch)
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    for hf_name, tensor in state_dict.items():
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        data = tensor.float().numpy()
        if source_arch == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if base.endswith("q_proj") else config.num_key_value_heads
            data = llama_cpp_permute(data, heads)
        if data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's interleaving of q/k rows for its rope (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _add_hparams(writer: gguf.GGUFWriter, config) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_vocab_size(config.vocab_size)


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer) -> None:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = set(tokenizer.all_special_ids)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for _, i in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)


def heron_logits(llm, prompt: list[int]) -> torch.Tensor:
    """Logits at every prompt position from one paged prefill (straight through the model runner)."""
    from heron.engine.scheduler import ScheduledSeq, SchedulerOutput

    core = llm.engine.core
    bm = core.block_manager
    blocks = [bm._take_free_block().block_id for _ in range(bm.blocks_needed(len(prompt)))]
    probe = ScheduledSeq(-1, list(prompt), 0, len(prompt), blocks, True, num_prompt_rows=len(prompt))
    logits = core.runner.compute_logits(core.runner.execute(SchedulerOutput(seqs=[probe])))
    core.runner.execute(SchedulerOutput(freed_seq_ids=[-1]))
    for b in blocks:
        bm._unref(b)
    return logits


def assert_no_leaks(llm) -> None:
    """Every KV block back in the free list, the block manager consistent, no request left in the core."""
    core = llm.engine.core
    core.block_manager.check_invariants()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    assert not core.scheduler.has_unfinished() and not core.requests
