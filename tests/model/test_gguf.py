"""load_gguf: tiny models written as GGUF round-trip to the same weights, config and tokenizer; bad files fail."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from helpers import TINY_ARCHS, write_gguf
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from heron.errors import ModelLoadError
from heron.model.gguf import load_gguf

Q = gguf.GGMLQuantizationType
TEXTS = ["Hello, world! How are you?", "def add(a, b):\n    return a + b", "héron 🐦 über naïve — ok", ""]


@pytest.fixture(scope="module")
def gguf_file(tiny_model_dir, tmp_path_factory):
    """Factory ``gguf_file(arch, qtype=F32) -> Path``, cached per module."""
    written = {}

    def make(arch: str, qtype: Q = Q.F32):
        if (arch, qtype) not in written:
            path = tmp_path_factory.mktemp("gguf") / f"{arch}-{qtype.name}.gguf"
            written[arch, qtype] = write_gguf(tiny_model_dir(arch), path, qtype)
        return written[arch, qtype]

    return make


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_f32_round_trip_is_exact(arch, tiny_model_dir, gguf_file):
    expected = load_file(tiny_model_dir(arch) / "model.safetensors")
    state_dict = load_gguf(gguf_file(arch), torch.float32).state_dict
    assert state_dict.keys() == expected.keys()
    for name, tensor in expected.items():
        assert state_dict[name].dtype == torch.float32
        assert torch.equal(state_dict[name], tensor), name


def test_llama_file_stores_permuted_q_k_rows(tiny_model_dir, gguf_file):
    """The round trip above only proves the un-permutation if the file really holds permuted rows."""
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(gguf_file("llama")).tensors}
    hf = load_file(tiny_model_dir("llama") / "model.safetensors")
    assert not np.array_equal(stored["blk.0.attn_q.weight"], hf["model.layers.0.self_attn.q_proj.weight"].numpy())
    assert np.array_equal(stored["blk.0.attn_v.weight"], hf["model.layers.0.self_attn.v_proj.weight"].numpy())


@pytest.mark.parametrize("arch", TINY_ARCHS)
# Q8_0 rounds to half a step (plus the fp16 scale's rounding); Q4_0 clips the far side of [-8, 7] by a step
@pytest.mark.parametrize(("qtype", "levels", "max_steps"), [(Q.Q8_0, 127, 0.6), (Q.Q4_0, 8, 1.01)])
def test_quantized_round_trip_within_quantization_error(arch, qtype, levels, max_steps, tiny_model_dir,
                                                        gguf_file):
    expected = load_file(tiny_model_dir(arch) / "model.safetensors")
    state_dict = load_gguf(gguf_file(arch, qtype), torch.float32).state_dict
    assert state_dict.keys() == expected.keys()
    for name, tensor in expected.items():
        got = state_dict[name]
        assert got.shape == tensor.shape, name
        if tensor.ndim == 1:  # norms and biases stay F32, as llama.cpp writes them
            assert torch.equal(got, tensor), name
            continue
        step = tensor.abs().max() / levels  # a block's step is at most the whole tensor's
        assert (got - tensor).abs().max() <= max_steps * step, name
        assert not torch.equal(got, tensor), name


def test_dtype_is_applied(gguf_file):
    fp32 = load_gguf(gguf_file("qwen3"), torch.float32).state_dict
    bf16 = load_gguf(gguf_file("qwen3"), torch.bfloat16).state_dict
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16}
    assert all(torch.equal(bf16[k], fp32[k].to(torch.bfloat16)) for k in fp32)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_config_matches_the_original(arch, tiny_model_dir, gguf_file):
    original = AutoConfig.from_pretrained(tiny_model_dir(arch))
    config = load_gguf(gguf_file(arch), torch.float32).config
    assert type(config) is type(original)
    assert config.architectures == original.architectures
    for field in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                  "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
                  "rope_parameters", "sliding_window", "attention_bias"):
        assert getattr(config, field, None) == getattr(original, field, None), field


def test_tie_word_embeddings_follows_the_output_tensor(tiny_model_dir, tmp_path):
    for tie in (True, False):
        checkpoint = load_gguf(write_gguf(tiny_model_dir("qwen2", tie), tmp_path / f"{tie}.gguf"), torch.float32)
        assert checkpoint.config.tie_word_embeddings is tie
        assert ("lm_head.weight" in checkpoint.state_dict) is not tie


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokenizer_matches_the_original(arch, tiny_model_dir, gguf_file):
    original = AutoTokenizer.from_pretrained(tiny_model_dir(arch))
    tokenizer = load_gguf(gguf_file(arch), torch.float32).tokenizer
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == original(text)["input_ids"]
        assert tokenizer.decode(ids) == text
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.eos_token_id == original.eos_token_id
    assert tokenizer.chat_template == original.chat_template
    messages = [{"role": "user", "content": "Hi there"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    assert tokenizer("<|im_end|>", add_special_tokens=False)["input_ids"] == [2]


def _llama3_factors(config: LlamaConfig, factor: float) -> np.ndarray:
    """The rope_freqs tensor llama.cpp writes for Llama 3.1-style rope scaling."""
    params = {**config.rope_parameters, "rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    scaled = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**{**config.to_dict(), "rope_parameters": params}))[0]
    dim = config.head_dim
    base = config.rope_parameters["rope_theta"] ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return (base / scaled.double()).float().numpy()


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    factors = _llama3_factors(AutoConfig.from_pretrained(model_dir), 8.0)
    assert factors.max() == pytest.approx(8.0) and factors.min() == pytest.approx(1.0)
    assert ((factors > 1.01) & (factors < 7.99)).any()  # one frequency in the smoothed band
    path = write_gguf(model_dir, tmp_path / "l3.gguf", extra_tensors={"rope_freqs.weight": factors})
    checkpoint = load_gguf(path, torch.float32)
    assert checkpoint.config.rope_parameters == {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": pytest.approx(8.0), "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in checkpoint.state_dict


def test_unknown_rope_freqs_are_refused(tiny_model_dir, tmp_path):
    factors = np.linspace(1.0, 3.0, 8, dtype=np.float32)
    path = write_gguf(tiny_model_dir("llama"), tmp_path / "odd.gguf", extra_tensors={"rope_freqs.weight": factors})
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        load_gguf(path, torch.float32)


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_gguf(tmp_path / "nope.gguf", torch.float32)


@pytest.mark.parametrize("content", [b"", b"GGUF", np.random.default_rng(0).bytes(4096)])
def test_not_a_gguf_file(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_gguf(path, torch.float32)


@pytest.mark.parametrize("keep", [0.6, 0.01])  # cut in the tensor data / inside the header
def test_truncated_file(gguf_file, tmp_path, keep):
    data = gguf_file("llama").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match="corrupt or truncated") as info:
        load_gguf(path, torch.float32)
    assert "\n" not in str(info.value)


def test_garbage_after_magic(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + np.random.default_rng(1).bytes(4096))
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_gguf(path, torch.float32)


def test_unsupported_architecture(tiny_model_dir, tmp_path):
    path = write_gguf(tiny_model_dir("llama"), tmp_path / "gpt2.gguf", architecture="gpt2")
    with pytest.raises(ModelLoadError, match=r"'gpt2' is not supported; heron supports llama, mistral, qwen2, qwen3"):
        load_gguf(path, torch.float32)


def test_unsupported_tensor_type(tiny_model_dir, tmp_path):
    extra = {"blk.0.attn_q.scale": np.ones((4, 32), dtype=np.int8)}
    path = write_gguf(tiny_model_dir("llama"), tmp_path / "i8.gguf", extra_tensors=extra)
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_q\.scale is stored as I8.*supported types: F32"):
        load_gguf(path, torch.float32)


def test_unexpected_tensor(tiny_model_dir, tmp_path):
    extra = {"blk.0.mystery.weight": np.ones((4, 32), dtype=np.float32)}
    path = write_gguf(tiny_model_dir("llama"), tmp_path / "extra.gguf", extra_tensors=extra)
    with pytest.raises(ModelLoadError, match="unexpected tensor blk.0.mystery.weight"):
        load_gguf(path, torch.float32)


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return load_gguf(smollm2_path, torch.float32)


def test_smollm2_config(smollm2):
    config = smollm2.config
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size) == (30, 576, 9, 3, 49152)
    assert (config.intermediate_size, config.head_dim, config.max_position_embeddings) == (1536, 64, 8192)
    assert config.rms_norm_eps == 1e-5 and config.rope_parameters["rope_theta"] == 100000.0
    assert config.tie_word_embeddings and (config.bos_token_id, config.eos_token_id) == (1, 2)


def test_smollm2_weights(smollm2):
    state_dict = smollm2.state_dict
    assert len(state_dict) == 2 + 30 * 9 and "lm_head.weight" not in state_dict
    assert state_dict["model.embed_tokens.weight"].shape == (49152, 576)
    assert state_dict["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert state_dict["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert state_dict["model.layers.7.mlp.down_proj.weight"].shape == (576, 1536)
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
        assert torch.isfinite(state_dict[name]).all() and state_dict[name].std() > 0, name


def test_smollm2_tokenizer(smollm2):
    tokenizer = smollm2.tokenizer
    for text in TEXTS:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer("Hello, world!")["input_ids"] == [19556, 28, 905, 17]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>user\nHi<|im_end|>\n"
                                                                          "<|im_start|>assistant\n")
