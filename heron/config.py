"""Engine configuration: one dataclass that the command line is generated from."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
from dataclasses import dataclass, field

from heron.errors import ConfigError
from heron.pooling_params import PoolerConfig
from heron.spec_decode.config import SpeculativeConfig

DEFAULT_MODEL = "smollm2-135m-instruct"

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
               "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tib": 1024**4}


def parse_size(text: str | int) -> int:
    """Parse a byte count such as ``2GiB``, ``512MB`` or ``1073741824``."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(f"cannot parse size {text!r}; use e.g. 2GiB, 512MiB or a byte count")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def _flag(help: str, **kw):
    return field(metadata={"help": help, **kw.pop("meta", {})}, **kw)


@dataclass
class EngineConfig:
    """Everything that shapes an engine. ``add_cli_args``/``from_cli_args`` map it to vLLM-named flags."""

    model: str = _flag("model: a local HF directory, a .gguf file, an HF cache id (org/name), "
                       f"or the built-in '{DEFAULT_MODEL}'", default=DEFAULT_MODEL)
    tokenizer: str | None = _flag("tokenizer path (defaults to the model's)", default=None)
    served_model_name: str | None = _flag("model name the API reports (defaults to --model)", default=None)
    dtype: str = _flag("weight/activation dtype: auto, float32, bfloat16, float16", default="auto",
                       meta={"choices": ["auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp32", "fp16"]})
    device: str = _flag("device: auto, cpu or cuda", default="auto", meta={"choices": ["auto", "cpu", "cuda"]})
    seed: int = _flag("global random seed", default=0)
    max_model_len: int | None = _flag("maximum context length (prompt + output); defaults to the model's", default=None)
    block_size: int = _flag("tokens per KV-cache block", default=16)
    gpu_memory_utilization: float = _flag("fraction of GPU memory heron may use (CUDA)", default=0.9)
    kv_cache_memory: str | None = _flag("KV-cache budget in bytes, e.g. 2GiB (CPU default: a tenth of RAM, "
                                        "1-4GiB; overrides --gpu-memory-utilization on CUDA)", default=None)
    num_gpu_blocks_override: int | None = _flag("use exactly this many KV blocks (testing)", default=None)
    kv_cache_dtype: str = _flag("KV-cache dtype: auto (= model dtype), or fp8 (= fp8_e4m3) / fp8_e5m2: one byte "
                                "per element, twice the tokens in the same memory", default="auto",
                                meta={"choices": ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]})
    calculate_kv_scales: bool = _flag("fp8 KV cache: compute the K and V scales from the first batch instead of "
                                      "using 1.0", default=False)
    max_num_seqs: int = _flag("maximum sequences in one batch", default=256)
    max_num_batched_tokens: int = _flag("token budget of one engine step (chunked prefill above it)", default=2048)
    enable_prefix_caching: bool = _flag("automatic prefix caching", default=True)
    enable_chunked_prefill: bool = _flag("split long prompts over several steps", default=True)
    tensor_parallel_size: int = _flag("tensor-parallel degree: ranks that each hold 1/N of every layer (their heads, "
                                      "MLP columns and vocabulary rows) and of the KV pool; --kv-cache-memory is "
                                      "per rank", default=1)
    distributed_executor_backend: str = _flag("how the tensor-parallel ranks run: mp (processes of this machine) or "
                                              "ray (Ray actors, possibly on several machines of a Ray cluster)",
                                              default="mp", meta={"choices": ["mp", "ray"]})
    quantization: str | None = _flag("weight quantization: gguf (a GGUF's blocks kept quantized; the default for a "
                                     "GGUF on the CPU), int8 / int4 (weight-only, from a full-precision checkpoint), "
                                     "fp8, awq, gptq; default: the checkpoint's own", default=None)
    attention_backend: str = _flag("attention backend: auto (the CPU paged kernel on the CPU, else reference), "
                                   "reference (gather + SDPA, exact), cpu_paged, triton_paged (CUDA, needs Triton; "
                                   "not yet run on a GPU)", default="auto",
                                   meta={"choices": ["auto", "reference", "cpu_paged", "triton_paged"]})
    cpu_threads: int | None = _flag("intra-op threads of the engine core on the CPU (llama.cpp's -t); default: "
                                    "one per physical core this process may use, one fewer when serving on 4 or more "
                                    "(the API process needs one); env HERON_CPU_THREADS", default=None)
    enforce_eager: bool = _flag("accepted for vLLM compatibility (heron always runs eagerly)", default=False)
    speculative_model: str | None = _flag("draft model for speculative decoding", default=None)
    num_speculative_tokens: int | None = _flag("tokens proposed per speculative step", default=None)
    speculative_config: str | dict | None = _flag(
        'speculative decoding as JSON (vLLM\'s), e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4}\'; methods ngram, draft_model ("model": path), self_draft ("draft_layers": N)',
        default=None)
    chat_template: str | None = _flag("Jinja chat template, or a file holding one", default=None)
    generation_config: str = _flag("sampling defaults for fields a request leaves out: auto (the model's "
                                   "generation_config.json, if any), vllm (ignore it), or a folder holding a "
                                   "generation_config.json", default="auto")
    max_waiting_requests: int = _flag("bound on queued requests; beyond it new ones are refused (503)", default=1024)
    runner: str = _flag("what the engine does with a prompt: generate text, or pool it into one vector (pooling: "
                        "serves /v1/embeddings and /pooling); auto is pooling with --task embed, else generate",
                        default="auto", meta={"choices": ["auto", "generate", "pooling"]})
    task: str | None = _flag("vLLM's older name for the runner: embed (= --runner pooling) or generate",
                             default=None, meta={"choices": ["auto", "generate", "embed", "embedding"]})
    pooler_config: str | dict | None = _flag(
        'pooling as JSON, e.g. \'{"pooling_type": "MEAN", "normalize": true}\'; pooling_type LAST (the default), '
        "MEAN or CLS; --runner pooling only", default=None)

    def __post_init__(self) -> None:
        self.runner = self._resolve_runner()
        self.validate()

    def _resolve_runner(self) -> str:
        """``--runner`` with ``auto`` and vLLM's older ``--task`` resolved to generate or pooling."""
        implied = {"embed": "pooling", "embedding": "pooling", "generate": "generate"}.get(self.task or "auto")
        if self.runner == "auto":
            return implied or "generate"
        if implied not in (None, self.runner):
            raise ConfigError(f"--task {self.task} contradicts --runner {self.runner}; give one of them")
        return self.runner

    def validate(self) -> None:
        """Reject values heron cannot honour, with a message saying what to do."""
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"--block-size must be a positive power of two, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("--max-num-seqs and --max-num-batched-tokens must be >= 1")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ConfigError(f"--cpu-threads must be at least 1, got {self.cpu_threads}")
        if self.kv_cache_memory is not None:
            parse_size(self.kv_cache_memory)
        if self.pooler_config is not None and self.runner != "pooling":
            raise ConfigError("--pooler-config applies to --runner pooling only")
        PoolerConfig.parse(self.pooler_config)  # raises ConfigError on a bad value
        if self.speculative is not None and self.runner == "pooling":
            raise ConfigError("speculative decoding applies to generation, not to --runner pooling")
        self._validate_parallel()

    def _validate_parallel(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"--tensor-parallel-size must be at least 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size == 1:
            return
        spec = self.speculative
        if spec is not None and spec.method != "ngram":
            raise ConfigError(f"speculative decoding with a {spec.method} proposer is not supported with "
                              "--tensor-parallel-size > 1 yet; use the ngram method, or one rank")
        if self.distributed_executor_backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ConfigError("--distributed-executor-backend ray needs Ray: pip install 'heron[ray]' "
                              "(or pip install ray)")

    @property
    def pooler(self) -> PoolerConfig:
        """The parsed ``--pooler-config`` (the defaults when not given)."""
        return PoolerConfig.parse(self.pooler_config)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed speculative-decoding settings (None: no speculation)."""
        return SpeculativeConfig.parse(self.speculative_config, self.speculative_model, self.num_speculative_tokens)

    @property
    def kv_cache_bytes(self) -> int | None:
        return None if self.kv_cache_memory is None else parse_size(self.kv_cache_memory)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """Add one ``--flag`` per field, named as vLLM names them."""
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            kw = {"help": f.metadata["help"] + f" (default: {f.default})", "default": f.default, "dest": f.name}
            if f.type in ("bool", bool):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
                continue
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
            base = f.type.split(" |")[0] if isinstance(f.type, str) else f.type
            kw["type"] = {"int": int, "float": float}.get(base, str)
            parser.add_argument(flag, **kw)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})
