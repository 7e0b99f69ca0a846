"""GGUF checkpoints (llama.cpp's format): a transformers config, HF-named dequantized tensors and a tokenizer.

The header is parsed here (string arrays are skipped, so this takes milliseconds where ``gguf.GGUFReader``
takes seconds); tensors are dequantized with the ``gguf`` package, llama's q/k rows are un-permuted with
transformers' own tensor processor, and the tokenizer is transformers' GGUF tokenizer.
"""

from __future__ import annotations

import copy
import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, MODEL_TENSOR, TENSOR_NAMES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize
from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from heron.errors import ModelLoadError
from heron.quantization.gguf import GGUFWeight

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
_ARCH_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_Q = GGMLQuantizationType
SUPPORTED_TYPES = (_Q.F32, _Q.F16, _Q.BF16, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0,
                   _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K)

_MAGIC = b"GGUF"
_SCALARS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
            GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
            GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
            GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}

_M = MODEL_TENSOR
# GGUF tensor -> HF parameter prefix; layer entries are relative to "model.layers.{bid}."
_GLOBAL_TENSORS = {_M.TOKEN_EMBD: "model.embed_tokens", _M.OUTPUT_NORM: "model.norm", _M.OUTPUT: "lm_head"}
_LAYER_TENSORS = {
    _M.ATTN_NORM: "input_layernorm", _M.ATTN_Q: "self_attn.q_proj", _M.ATTN_K: "self_attn.k_proj",
    _M.ATTN_V: "self_attn.v_proj", _M.ATTN_OUT: "self_attn.o_proj", _M.ATTN_Q_NORM: "self_attn.q_norm",
    _M.ATTN_K_NORM: "self_attn.k_norm", _M.FFN_NORM: "post_attention_layernorm",
    _M.FFN_GATE: "mlp.gate_proj", _M.FFN_UP: "mlp.up_proj", _M.FFN_DOWN: "mlp.down_proj",
}
_ROPE_FREQS = TENSOR_NAMES[_M.ROPE_FREQS] + ".weight"


@dataclass
class GGUFCheckpoint:
    """What a GGUF file holds, in transformers' terms."""

    config: PretrainedConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: PreTrainedTokenizerBase


@dataclass
class _TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (GGUF stores the fastest-moving dimension first)
    qtype: GGMLQuantizationType
    offset: int  # from the start of the file
    nbytes: int


@dataclass
class _Header:
    metadata: dict = field(default_factory=dict)
    tensors: dict[str, _TensorInfo] = field(default_factory=dict)


def load_gguf(path: str | Path, dtype: torch.dtype, keep_quantized: bool = False) -> GGUFCheckpoint:
    """Read a GGUF file of a supported architecture, dequantizing every tensor to ``dtype``; with
    ``keep_quantized`` the linear layers' weights stay in their blocks instead (``GGUFWeight``s, for
    ``--quantization gguf``), a tied embedding also serving as a quantized LM head."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        if path.stat().st_size < 24 or f.read(4) != _MAGIC:
            raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # unmapped once no array views it
    header = _read_header(buf, path)
    if header.metadata.get("split.count", 1) > 1:
        raise ModelLoadError(f"{path} is one part of a split GGUF; merge the parts first "
                             "(llama-gguf-split --merge) and load the merged file")
    model_type = _model_type(header.metadata, path)
    config = _config(header, model_type, path)
    if _ROPE_FREQS in header.tensors:
        factors = torch.from_numpy(_dequantize(buf, header.tensors[_ROPE_FREQS]))
        config.rope_parameters = _llama3_rope(config, factors, path)
    state_dict = _state_dict(buf, header, config, dtype, keep_quantized)
    if keep_quantized and config.tie_word_embeddings:
        # the LM head reads the embedding's blocks; the embedding lookup keeps its dequantized copy
        state_dict["lm_head.weight"] = _blocks(buf, header.tensors[TENSOR_NAMES[_M.TOKEN_EMBD] + ".weight"])
        config.tie_word_embeddings = False
    return GGUFCheckpoint(config, state_dict, gguf_tokenizer(path))


def _read_header(buf: mmap.mmap, path: Path) -> _Header:
    """Metadata (string arrays left as their length) and the tensor table, bounds-checked."""
    try:
        return _Reader(buf).header(path)
    except (struct.error, ValueError, UnicodeDecodeError, OverflowError, MemoryError) as e:
        raise ModelLoadError(f"{path} is a corrupt or truncated GGUF file ({e})") from e


class _Reader:
    """A cursor over the GGUF header bytes."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 4

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def one(self, fmt: str):
        return self.unpack(fmt)[0]

    def string(self) -> str:
        n = self.one("Q")
        if self.pos + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        self.pos += n
        return self.buf[self.pos - n:self.pos].decode("utf-8")

    def value(self, vtype: int):
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype in _SCALARS:
            return self.one(_SCALARS[vtype])
        if vtype != GGUFValueType.ARRAY:
            raise ValueError(f"unknown metadata value type {vtype}")
        etype, count = self.unpack("IQ")
        if etype in _SCALARS:
            return list(self.unpack(f"{count}{_SCALARS[etype]}"))
        for _ in range(count):  # vocabularies and merge tables: transformers' tokenizer reads them itself
            self.value(etype)
        return count

    def header(self, path: Path) -> _Header:
        version, n_tensors, n_kv = self.unpack("IQQ")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        header = _Header()
        for _ in range(n_kv):
            key = self.string()
            header.metadata[key] = self.value(self.one("I"))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = header.metadata.get("general.alignment", 32)
        data_start = (self.pos + align - 1) // align * align
        for name, shape, qtype, offset in infos:
            info = _tensor(name, shape, qtype, data_start + offset, path)
            if info.offset + info.nbytes > len(self.buf):
                raise ValueError(f"tensor {name} runs past the end of the file")
            header.tensors[name] = info
        return header

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string()
        dims = self.unpack(f"{self.one('I')}Q")
        qtype, offset = self.unpack("IQ")
        return name, tuple(reversed(dims)), qtype, offset


def _tensor(name: str, shape: tuple[int, ...], qtype: int, offset: int, path: Path) -> _TensorInfo:
    """Check that heron can dequantize ``qtype`` and size the tensor's bytes."""
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        raise ModelLoadError(f"{path}: tensor {name} has unknown ggml type id {qtype}") from None
    if qtype not in SUPPORTED_TYPES:
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ModelLoadError(f"{path}: tensor {name} is stored as {qtype.name}, which heron cannot "
                             f"dequantize; supported types: {supported}")
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    if not shape or shape[-1] % block:
        raise ValueError(f"tensor {name} of shape {shape} does not split into {qtype.name} blocks")
    return _TensorInfo(name, shape, qtype, offset, math.prod(shape) // block * block_bytes)


def _model_type(meta: dict, path: Path) -> str:
    """The transformers model_type of the file; llama.cpp writes Mistral models as "llama"."""
    arch = meta.get("general.architecture")
    names = f"{meta.get('general.name', '')} {meta.get('general.basename', '')}".lower()
    if arch == "llama" and "mistral" in names:
        return "mistral"
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported; "
                             f"heron supports {', '.join(SUPPORTED_ARCHS)}")
    return arch


def _config(header: _Header, model_type: str, path: Path) -> PretrainedConfig:
    """A transformers config of ``model_type`` from the ``<arch>.*`` metadata and the tensor table."""
    meta, tensors = header.metadata, header.tensors
    arch = meta["general.architecture"]

    def get(key: str, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return float(f"{value:.7g}") if isinstance(value, float) else value  # f32 1e-5 -> 1e-05

    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: GGUF file has no token_embd.weight tensor")
    hidden, heads = get("embedding_length"), get("attention.head_count")
    kwargs = dict(
        vocab_size=tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=get("attention.key_length", meta.get(f"{arch}.rope.dimension_count", hidden // heads)),
        max_position_embeddings=get("context_length"),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        rope_theta=get("rope.freq_base", 10000.0),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        architectures=[_ARCH_CLASSES[model_type]],
    )
    if model_type in ("llama", "qwen3"):
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if model_type == "mistral":
        kwargs["sliding_window"] = meta.get(f"{arch}.attention.sliding_window")
    config = AutoConfig.for_model(model_type, **kwargs)
    _set_rope_scaling(config, meta, arch, path)
    return config


def _set_rope_scaling(config: PretrainedConfig, meta: dict, arch: str, path: Path) -> None:
    """Carry linear or yarn rope scaling over from the metadata."""
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind in ("linear", "yarn"):
        params = {"rope_type": kind, "factor": meta[f"{arch}.rope.scaling.factor"]}
        if f"{arch}.rope.scaling.original_context_length" in meta:
            params["original_max_position_embeddings"] = meta[f"{arch}.rope.scaling.original_context_length"]
        config.rope_parameters = {**config.rope_parameters, **params}
    elif kind != "none":
        raise ModelLoadError(f"{path}: rope scaling type {kind!r} is not supported")


def _llama3_rope(config: PretrainedConfig, factors: torch.Tensor, path: Path) -> dict:
    """llama.cpp stores Llama 3.1+ rope scaling as per-frequency factors; find the HF parameters behind them."""
    dim = 2 * len(factors)
    base = config.rope_parameters["rope_theta"] ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    params = {**config.rope_parameters, "rope_type": "llama3", "factor": float(factors.max()),
              "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    candidate = copy.deepcopy(config)
    candidate.rope_parameters = params
    inv_freq = ROPE_INIT_FUNCTIONS["llama3"](candidate)[0].double()
    if not torch.allclose(inv_freq, base / factors.double(), rtol=1e-3):
        raise ModelLoadError(f"{path}: its rope_freqs tensor matches no llama3 rope scaling heron knows")
    return params


def _state_dict(buf: mmap.mmap, header: _Header, config: PretrainedConfig, dtype: torch.dtype,
                keep_quantized: bool) -> dict:
    """Every tensor un-permuted and renamed to its HF parameter name: dequantized, or with ``keep_quantized``
    the linear layers' weights in their blocks."""
    names = _hf_names(config.num_hidden_layers)
    processor = TENSOR_PROCESSORS.get(header.metadata["general.architecture"], TensorProcessor)(
        config={"num_attention_heads": config.num_attention_heads,
                "num_key_value_heads": config.num_key_value_heads})
    state_dict = {}
    for name, info in header.tensors.items():
        if name == _ROPE_FREQS:
            continue
        if name not in names:
            raise ModelLoadError(f"unexpected tensor {name} in the GGUF file of a {config.model_type} model")
        hf_name = names[name]
        if keep_quantized and _is_linear(hf_name):
            blocks = _blocks(buf, info)  # rows hold whole blocks, so the row permutation applies to them as is
            blocks.blocks = processor.process(weights=blocks.blocks, name=name).weights
            state_dict[hf_name] = blocks
            continue
        weights = _dequantize(buf, info).reshape(info.shape)
        weights = processor.process(weights=weights, name=name).weights  # llama.cpp permutes llama's q/k rows
        state_dict[hf_name] = torch.from_numpy(np.ascontiguousarray(weights)).to(dtype)
    return state_dict


def _is_linear(hf_name: str) -> bool:
    return hf_name.endswith(("_proj.weight", "lm_head.weight"))


def _blocks(buf: mmap.mmap, info: _TensorInfo) -> GGUFWeight:
    """The tensor's blocks, one row of the weight per row (a view of the file)."""
    rows, cols = info.shape
    data = np.frombuffer(buf, dtype=np.uint8, count=info.nbytes, offset=info.offset).reshape(rows, -1)
    return GGUFWeight(data, info.qtype, (rows, cols))


def _hf_names(num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> HF parameter name, for weights and biases."""
    pairs = [(TENSOR_NAMES[t], hf) for t, hf in _GLOBAL_TENSORS.items()]
    pairs += [(TENSOR_NAMES[t].format(bid=i), f"model.layers.{i}.{hf}")
              for i in range(num_layers) for t, hf in _LAYER_TENSORS.items()]
    return {f"{g}.{s}": f"{hf}.{s}" for g, hf in pairs for s in ("weight", "bias")}


def _dequantize(buf: mmap.mmap, info: _TensorInfo) -> np.ndarray:
    """The tensor's values as a flat float32 array (a copy: the file can be closed afterwards)."""
    values = dequantize(np.frombuffer(buf, dtype=np.uint8, count=info.nbytes, offset=info.offset), info.qtype)
    return values.copy() if info.qtype == _Q.F32 else values  # F32 is a view of the file


def gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """transformers' tokenizer from the GGUF vocabulary, with ``tokenizer.chat_template`` as chat template.

    Reads only the metadata (no tensor is dequantized): what a process that serves no weights needs."""
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:  # transformers raises many types here; the user needs one line
        raise ModelLoadError(f"cannot build a tokenizer from {path}: {e}") from e
