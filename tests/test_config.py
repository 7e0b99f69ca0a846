"""EngineConfig: vLLM-named flags generated from the dataclass, and refusal of unbuilt features."""

from __future__ import annotations

import argparse

import pytest

from heron.config import EngineConfig
from heron.errors import ConfigError


def parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    return EngineConfig.from_cli_args(parser.parse_args(list(argv)))


def test_flags_have_vllm_names_and_types():
    cfg = parse("--model", "m", "--max-model-len", "1024", "--block-size", "32", "--gpu-memory-utilization",
                "0.5", "--no-enable-prefix-caching", "--max-num-seqs", "8", "--kv-cache-memory", "1GiB",
                "--enforce-eager", "--dtype", "bfloat16")
    assert (cfg.model, cfg.max_model_len, cfg.block_size, cfg.gpu_memory_utilization) == ("m", 1024, 32, 0.5)
    assert cfg.enable_prefix_caching is False and cfg.max_num_seqs == 8 and cfg.kv_cache_bytes == 1 << 30
    assert parse().enable_prefix_caching is True


@pytest.mark.parametrize("argv, needle", [
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be at least 1"),
    (["--tensor-parallel-size", "2", "--speculative-config", '{"method": "self_draft", "num_speculative_tokens": 2}'],
     "self_draft proposer is not supported with --tensor-parallel-size > 1"),
    (["--speculative-model", "draft"], "--num-speculative-tokens"),
    (["--num-speculative-tokens", "4"], "--speculative-model"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'], "num_speculative_tokens"),
    (["--block-size", "12"], "power of two"),
    (["--gpu-memory-utilization", "1.5"], "gpu-memory-utilization"),
    (["--kv-cache-memory", "lots"], "cannot parse size"),
])
def test_unbuilt_or_invalid_options_are_refused(argv, needle):
    with pytest.raises(ConfigError, match=needle):
        parse(*argv)
