"""AWQ and GPTQ checkpoints built here from the formats' definitions, loaded exactly.

The packers below follow the quantizers' own code, written independently of heron's unpacking: AutoAWQ's
``WQLinear_GEMM.from_linear`` (``qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << (i * 4)``) and
auto-gptq's ``QuantLinear.pack`` (``qweight[row] |= intweight[j] << (bits * (j - i))``, zeros minus one in v1).
Each tiny checkpoint must give the logits of the float model built from its dequantized weights.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import heron_logits
from safetensors.torch import load_file, save_file

from heron import LLM
from heron.errors import ModelLoadError
from heron.layers.linear import MergedLinear
from heron.model.loader import load_model
from heron.quantization.awq_gptq import AWQLinearMethod, GPTQLinearMethod, unpack_int32
from heron.quantization.base import UnquantizedLinearMethod

from .test_int_weight import assert_matches_reference, meta_built

CPU = torch.device("cpu")
AUTOAWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order_map, copied from its packer


def to_int32(words: np.ndarray) -> torch.Tensor:
    """uint32 words as the int32 tensor a checkpoint stores (the same bits)."""
    return torch.from_numpy(words.astype(np.uint32).view(np.int32))


def awq_pack(intweight: torch.Tensor) -> torch.Tensor:
    """AutoAWQ: ``intweight`` [rows, cols] of 4-bit values -> int32 [rows, cols / 8]."""
    values = intweight.numpy().astype(np.uint32)
    packed = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint32)
    for col in range(packed.shape[1]):
        for i in range(8):
            packed[:, col] |= values[:, col * 8 + AUTOAWQ_ORDER_MAP[i]] << (i * 4)
    return to_int32(packed)


def gptq_pack_rows(intweight: torch.Tensor, bits: int) -> torch.Tensor:
    """auto-gptq's qweight: ``intweight`` [in, out] -> int32 [in * bits / 32, out], low bits first."""
    values, per_word = intweight.numpy().astype(np.uint32), 32 // bits
    packed = np.zeros((values.shape[0] // per_word, values.shape[1]), dtype=np.uint32)
    for row in range(packed.shape[0]):
        for j in range(per_word):
            packed[row] |= values[row * per_word + j] << (bits * j)
    return to_int32(packed)


def gptq_pack_columns(zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """auto-gptq's qzeros: ``zeros`` [groups, out] -> int32 [groups, out * bits / 32], low bits first."""
    values, per_word = zeros.numpy().astype(np.uint32), 32 // bits
    packed = np.zeros((values.shape[0], values.shape[1] // per_word), dtype=np.uint32)
    for col in range(packed.shape[1]):
        for j in range(per_word):
            packed[:, col] |= values[:, col * per_word + j] << (bits * j)
    return to_int32(packed)


@dataclass
class Quantized:
    """One layer's weight [out, in] in a checkpoint's integers: ``q`` [in, out], ``zeros`` and float16
    ``scales`` [groups, out], ``g_idx`` [in]; ``weight`` is the dequantized float32 weight."""

    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor
    weight: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        rows = self.g_idx.long()
        self.weight = ((self.q - self.zeros[rows]).float() * self.scales[rows].float()).t().contiguous()


def quantize(w: torch.Tensor, bits: int, g_idx: torch.Tensor, sym: bool, min_zero: int = 0) -> Quantized:
    """Round-to-nearest group quantization of ``w`` [out, in] over the groups ``g_idx`` gives its inputs:
    min-max with a zero point in [min_zero, 2**bits - 1], or symmetric around 2**(bits - 1)."""
    maxq, groups = 2**bits - 1, int(g_idx.max()) + 1
    members = [w[:, g_idx == g] for g in range(groups)]
    if sym:
        scales = torch.stack([2 * m.abs().amax(1) / maxq for m in members]).half()
        zeros = torch.full(scales.shape, 2 ** (bits - 1), dtype=torch.int32)
    else:
        lo = torch.stack([m.amin(1).clamp(max=0) for m in members])
        hi = torch.stack([m.amax(1).clamp(min=0) for m in members])
        scales = ((hi - lo) / maxq).clamp(min=1e-4).half()
        zeros = torch.round(-lo / scales.float()).clamp(min_zero, maxq).int()
    rows = g_idx.long()
    q = torch.round(w.t() / scales[rows].float()) + zeros[rows]
    return Quantized(q.clamp(0, maxq).int(), zeros, scales, g_idx.int())


@dataclass
class Variant:
    """A checkpoint to build, described by its ``quantization_config``."""

    config: dict

    @property
    def method(self) -> str:
        return self.config["quant_method"]

    @property
    def bits(self) -> int:
        return self.config["bits"]

    @property
    def sym(self) -> bool:
        return self.config.get("sym", False)

    @property
    def desc_act(self) -> bool:
        return self.config.get("desc_act", False)

    @property
    def lm_head(self) -> bool:
        return self.config.get("lm_head", False)

    @property
    def v1(self) -> bool:
        """GPTQ's v1 format, which stores zero points minus one."""
        return self.method == "gptq" and self.config.get("checkpoint_format") != "gptq_v2"

    def group(self, input_size: int) -> int:
        return input_size if self.config["group_size"] == -1 else self.config["group_size"]


def awq(group_size: int = 32, **config) -> Variant:
    return Variant({"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                    "version": "gemm", **config})


def gptq(bits: int = 4, group_size: int = 32, sym: bool = False, desc_act: bool = False, lm_head: bool = False,
         checkpoint_format: str = "gptq") -> Variant:
    return Variant({"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym,
                    "desc_act": desc_act, "lm_head": lm_head, "checkpoint_format": checkpoint_format})


def layer_g_idx(variant: Variant, input_size: int, seed: int) -> torch.Tensor:
    """Each input's group: in order, or (act-order) in a random order, every group ``group`` inputs."""
    group = variant.group(input_size)
    if not variant.desc_act:
        return torch.arange(input_size) // group
    order = torch.randperm(input_size, generator=torch.Generator().manual_seed(seed))
    return torch.argsort(order) // group  # the inputs GPTQ visits i-th, in group i // group


def checkpoint_tensors(variant: Variant, prefix: str, quantized: Quantized) -> dict[str, torch.Tensor]:
    """The tensors ``prefix``.qweight etc. of one layer in ``variant``'s format."""
    if variant.method == "awq":
        return {f"{prefix}.qweight": awq_pack(quantized.q), f"{prefix}.qzeros": awq_pack(quantized.zeros),
                f"{prefix}.scales": quantized.scales}
    stored_zeros = quantized.zeros - 1 if variant.v1 else quantized.zeros
    return {f"{prefix}.qweight": gptq_pack_rows(quantized.q, variant.bits),
            f"{prefix}.qzeros": gptq_pack_columns(stored_zeros, variant.bits),
            f"{prefix}.scales": quantized.scales, f"{prefix}.g_idx": quantized.g_idx}


def same_input(prefix: str) -> str:
    """What an act-order layer shares its g_idx with: q/k/v read one input, gate/up another, and GPTQ orders
    the inputs of each by the same statistics."""
    parent, _, module = prefix.rpartition(".")
    return parent if module in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") else prefix


def write_checkpoint(model_dir: Path, out: Path, variant: Variant, g_idx_of=same_input) -> tuple[Path, Path]:
    """``model_dir`` quantized as ``variant`` (its projections, its LM head when ``lm_head``; not those
    ``modules_to_not_convert`` names), and the float model of the dequantized weights. Act-order layers with
    the same ``g_idx_of`` share their g_idx."""
    quant_dir, float_dir = out / variant.method, out / "dequantized"
    quant, dequant = {}, {}
    skipped = variant.config.get("modules_to_not_convert") or []
    g_idx_seeds: dict[str, int] = {}
    for name, w in load_file(model_dir / "model.safetensors").items():
        prefix = name.removesuffix(".weight")
        quantized_here = (name.endswith("_proj.weight") or (variant.lm_head and name == "lm_head.weight"))
        if not quantized_here or any(entry in prefix for entry in skipped):
            quant[name] = dequant[name] = w
            continue
        seed = g_idx_seeds.setdefault(g_idx_of(prefix), len(g_idx_seeds))
        q = quantize(w, variant.bits, layer_g_idx(variant, w.shape[1], seed), variant.sym,
                     min_zero=int(variant.v1))  # a v1 zero of 0 would be stored as -1
        quant.update(checkpoint_tensors(variant, prefix, q))
        dequant[name] = q.weight
    for path, tensors in ((quant_dir, quant), (float_dir, dequant)):
        shutil.copytree(model_dir, path)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((quant_dir / "config.json").read_text())
    (quant_dir / "config.json").write_text(json.dumps({**config, "quantization_config": variant.config}))
    return quant_dir, float_dir


def test_unpack_int32_reverses_both_packers_including_the_sign_bit():
    values = torch.randint(0, 16, (16, 24), generator=torch.Generator().manual_seed(0))
    values[7], values[:, 7] = 15, 15  # the top nibble of a word along either axis: the int32's sign bit
    by_rows = unpack_int32(gptq_pack_rows(values, 4), 4, dim=0)
    by_columns = unpack_int32(gptq_pack_columns(values, 4), 4, dim=1)
    assert torch.equal(by_rows, values) and torch.equal(by_columns, values)
    bytes_ = torch.randint(0, 256, (8, 12), generator=torch.Generator().manual_seed(1))
    assert torch.equal(unpack_int32(gptq_pack_rows(bytes_, 8), 8, dim=0), bytes_)
    # AWQ's words hold their 8 columns out of order: nibble i is column AUTOAWQ_ORDER_MAP[i]
    nibbles = unpack_int32(awq_pack(values), 4, dim=1).view(16, 3, 8)
    assert torch.equal(nibbles, values.view(16, 3, 8)[:, :, AUTOAWQ_ORDER_MAP])


LAYER_VARIANTS = {
    "awq": awq(), "awq-g64": awq(64), "gptq-v1": gptq(), "gptq-sym": gptq(sym=True),
    "gptq-v2": gptq(checkpoint_format="gptq_v2"), "gptq-8bit": gptq(8),
    "gptq-8bit-sym-g64": gptq(8, 64, sym=True),
    "gptq-act-order": gptq(desc_act=True), "gptq-one-group": gptq(group_size=-1),
}


@pytest.mark.parametrize("name", LAYER_VARIANTS)
def test_merged_layer_unpacks_exactly_to_the_dequantized_weight(name):
    variant, sizes, input_size = LAYER_VARIANTS[name], [48, 16, 16], 128
    method_cls = AWQLinearMethod if variant.method == "awq" else GPTQLinearMethod
    method = method_cls.for_layer(variant.config, "qkv_proj")
    layer = meta_built(lambda: MergedLinear(input_size, sizes, quant_method=method))
    g_idx = layer_g_idx(variant, input_size, seed=0)
    shards = []
    for i, size in enumerate(sizes):  # each projection loaded as its own checkpoint tensors
        w = torch.randn(size, input_size, generator=torch.Generator().manual_seed(i))
        shards.append(quantize(w, variant.bits, g_idx, variant.sym, min_zero=int(variant.v1)))
        for key, tensor in checkpoint_tensors(variant, "p", shards[-1]).items():
            layer.weight_loader(getattr(layer, key.removeprefix("p.")), tensor, i)
    weight = torch.cat([s.weight for s in shards])
    method.process_weights_after_loading(layer)
    order = getattr(layer, "input_order", None)
    packed = layer.packed.dequantize()
    unpermuted = packed if order is None else packed[:, torch.argsort(order)]
    assert torch.equal(unpermuted, weight)
    assert (order is not None) == variant.desc_act
    for rows in (3, 40):
        x = torch.randn(rows, input_size)
        assert_matches_reference(layer(x), F.linear(x, weight))


MODEL_VARIANTS = {
    "awq": ("llama", awq()), "awq-qwen2-g64": ("qwen2", awq(64)),
    "awq-dense-down-proj": ("llama", awq(modules_to_not_convert=["down_proj"])),
    "gptq-v1": ("llama", gptq()), "gptq-sym-g64": ("qwen2", gptq(group_size=64, sym=True)),
    "gptq-v2": ("llama", gptq(checkpoint_format="gptq_v2")), "gptq-8bit": ("llama", gptq(8)),
    "gptq-act-order": ("qwen2", gptq(desc_act=True)),
    "gptq-one-group-lm-head": ("qwen2", gptq(group_size=-1, lm_head=True)),
}


@pytest.mark.parametrize("name", MODEL_VARIANTS)
def test_checkpoint_logits_equal_the_dequantized_float_model(tiny_model_dir, tmp_path, name):
    arch, variant = MODEL_VARIANTS[name]
    quant_dir, float_dir = write_checkpoint(tiny_model_dir(arch), tmp_path, variant)
    quantized = LLM(str(quant_dir), block_size=8, dtype="float32")
    reference = LLM(str(float_dir), block_size=8, dtype="float32")
    model = quantized.engine.core.runner.model
    head = GPTQLinearMethod if variant.lm_head else UnquantizedLinearMethod
    assert isinstance(model.lm_head.quant_method, head)
    dense_down = bool(variant.config.get("modules_to_not_convert"))
    assert isinstance(model.layers[0].mlp.down_proj.quant_method, UnquantizedLinearMethod) == dense_down
    g = torch.Generator().manual_seed(0)
    for length in (40, 12):
        prompt = torch.randint(3, 300, (length,), generator=g).tolist()
        assert_matches_reference(heron_logits(quantized, prompt), heron_logits(reference, prompt), rtol=0.05)


def test_bfloat16_model_keeps_the_float16_scales_exactly(tiny_model_dir, tmp_path):
    quant_dir, float_dir = write_checkpoint(tiny_model_dir("llama"), tmp_path, awq())
    model = load_model(str(quant_dir), torch.bfloat16, CPU).model
    expected = load_file(float_dir / "model.safetensors")
    o_proj = model.layers[1].self_attn.o_proj
    assert torch.equal(o_proj.packed.dequantize(), expected["model.layers.1.self_attn.o_proj.weight"])
    assert model.layers[1].input_layernorm.weight.dtype == torch.bfloat16


@pytest.fixture(scope="module")
def awq_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return write_checkpoint(tiny_model_dir("llama"), tmp_path_factory.mktemp("awq"), awq())[0]


def with_config(quant_dir: Path, out: Path, **changes) -> Path:
    """A copy of ``quant_dir`` whose quantization_config has ``changes`` (a None value removes a key)."""
    shutil.copytree(quant_dir, out)
    config = json.loads((out / "config.json").read_text())
    merged = {**config["quantization_config"], **changes}
    config["quantization_config"] = {k: v for k, v in merged.items() if v is not None}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("changes,message", [
    ({"version": "gemv"}, "version='gemv'"), ({"zero_point": False}, "zero_point=False"),
    ({"bits": 8}, "bits=8"), ({"quant_method": "gptq", "bits": 3}, "not 3-bit"),
    ({"bits": None}, "has no 'bits'"), ({"group_size": 48}, "group size 48"),
    ({"quant_method": "gptq", "dynamic": {"-:.*down_proj.*": {}}}, "per-module overrides"),
    ({"modules_to_not_convert": ["q_proj"]}, "leaves only some of self_attn.q_proj"),
])
def test_what_heron_cannot_load_exactly_is_one_clear_error(awq_dir, tmp_path, changes, message):
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(with_config(awq_dir, tmp_path / "changed", **changes)), torch.float32, CPU)


def test_act_order_projections_of_one_layer_must_share_their_order(tiny_model_dir, tmp_path):
    quant_dir, _ = write_checkpoint(tiny_model_dir("llama"), tmp_path, gptq(desc_act=True),
                                    g_idx_of=lambda prefix: prefix)
    with pytest.raises(ModelLoadError, match="different act-order g_idx"):
        load_model(str(quant_dir), torch.float32, CPU)


def test_quantization_flag_must_match_the_checkpoint(awq_dir, tiny_model_dir):
    model = load_model(str(awq_dir), torch.float32, CPU, quantization="awq").model
    assert isinstance(model.layers[0].self_attn.o_proj.quant_method, AWQLinearMethod)
    with pytest.raises(ModelLoadError, match="quantized with 'awq'; it cannot be loaded as 'int4'"):
        load_model(str(awq_dir), torch.float32, CPU, quantization="int4")
    with pytest.raises(ModelLoadError, match="--quantization gptq loads GPTQ checkpoints, and this one's"):
        load_model(str(tiny_model_dir("llama")), torch.float32, CPU, quantization="gptq")
