"""Benchmark prompts: random token strings, ShareGPT-format conversations, and prompts sharing a long prefix."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from heron.errors import ConfigError

DATASETS = ("random", "sharegpt", "prefix")


@dataclass
class SampleRequest:
    """One benchmark request: the prompt text, its length in tokens, and how many tokens to ask for."""

    prompt: str
    prompt_len: int
    expected_output_len: int


@dataclass
class DatasetSpec:
    """How to build the prompts (mirrors ``heron bench serve`` dataset flags)."""

    name: str = "random"
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0
    dataset_path: str | None = None
    prefix_len: int = 256
    num_prefixes: int = 1
    seed: int = 0

    def validate(self) -> None:
        """Reject inconsistent flags with a message that says what to fix."""
        if self.name not in DATASETS:
            raise ConfigError(f"unknown dataset {self.name!r}; choose one of {', '.join(DATASETS)}")
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ConfigError("--num-prompts, --input-len and --output-len must be >= 1")
        if not 0 <= self.range_ratio < 1:
            raise ConfigError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.name == "sharegpt" and not self.dataset_path:
            raise ConfigError("--dataset sharegpt needs --dataset-path FILE.json")
        if self.name == "prefix" and (self.prefix_len < 1 or self.num_prefixes < 1):
            raise ConfigError("--prefix-len and --num-prefixes must be >= 1")


def sample_requests(spec: DatasetSpec, tokenizer) -> list[SampleRequest]:
    """Build ``spec.num_prompts`` requests, deterministically from ``spec.seed``."""
    spec.validate()
    rng = np.random.default_rng(spec.seed)
    if spec.name == "random":
        return _random_requests(spec, tokenizer, rng)
    if spec.name == "prefix":
        return _prefix_requests(spec, tokenizer, rng)
    return _sharegpt_requests(spec, tokenizer, rng)


def _lengths(center: int, ratio: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` lengths uniform in [center*(1-ratio), center*(1+ratio)], at least 1."""
    low, high = max(1, int(center * (1 - ratio))), max(1, int(center * (1 + ratio)))
    return rng.integers(low, high + 1, size=n)


def _normal_token_ids(tokenizer) -> np.ndarray:
    """Ids of ordinary (non-special) tokens, so random prompts never contain control tokens."""
    special = set(tokenizer.all_special_ids)
    return np.array([i for i in range(len(tokenizer)) if i not in special])


def random_text(tokenizer, num_tokens: int, rng: np.random.Generator, vocab: np.ndarray) -> tuple[str, int]:
    """Text of about ``num_tokens`` random tokens; returns the text and its exact re-tokenized length."""
    ids = rng.choice(vocab, size=num_tokens).tolist()
    text = tokenizer.decode(ids)
    ids = tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
    text = tokenizer.decode(ids)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def _random_requests(spec: DatasetSpec, tokenizer, rng: np.random.Generator) -> list[SampleRequest]:
    vocab = _normal_token_ids(tokenizer)
    in_lens = _lengths(spec.input_len, spec.range_ratio, spec.num_prompts, rng)
    out_lens = _lengths(spec.output_len, spec.range_ratio, spec.num_prompts, rng)
    requests = []
    for n_in, n_out in zip(in_lens, out_lens, strict=True):
        text, n = random_text(tokenizer, int(n_in), rng, vocab)
        requests.append(SampleRequest(text, n, int(n_out)))
    return requests


def _prefix_requests(spec: DatasetSpec, tokenizer, rng: np.random.Generator) -> list[SampleRequest]:
    """Each prompt is one of ``num_prefixes`` long shared prefixes plus its own random suffix."""
    vocab = _normal_token_ids(tokenizer)
    prefixes = [random_text(tokenizer, spec.prefix_len, rng, vocab)[0] for _ in range(spec.num_prefixes)]
    in_lens = _lengths(spec.input_len, spec.range_ratio, spec.num_prompts, rng)
    out_lens = _lengths(spec.output_len, spec.range_ratio, spec.num_prompts, rng)
    requests = []
    for i, (n_in, n_out) in enumerate(zip(in_lens, out_lens, strict=True)):
        suffix = random_text(tokenizer, int(n_in), rng, vocab)[0]
        prompt = prefixes[i % spec.num_prefixes] + "\n" + suffix
        requests.append(SampleRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), int(n_out)))
    return requests


def load_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(first human turn, first reply) pairs from a ShareGPT-format JSON file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read ShareGPT dataset {path}: {e}") from e
    if not isinstance(data, list):
        raise ConfigError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}} entries")
    pairs = []
    for entry in data:
        turns = (entry.get("conversations") or entry.get("conversation") or []) if isinstance(entry, dict) else []
        if len(turns) >= 2 and all(isinstance(t, dict) and "value" in t for t in turns[:2]):
            pairs.append((str(turns[0]["value"]), str(turns[1]["value"])))
    if not pairs:
        raise ConfigError(f"{path} holds no conversation with at least two turns")
    return pairs


def _sharegpt_requests(spec: DatasetSpec, tokenizer, rng: np.random.Generator) -> list[SampleRequest]:
    """Shuffle conversations; keep those of sane length (as vLLM: prompt <= 1024, prompt + reply <= 2048)."""
    pairs = load_sharegpt(spec.dataset_path)
    requests = []
    for idx in rng.permutation(len(pairs)):
        prompt, reply = pairs[idx]
        n_in = len(tokenizer.encode(prompt, add_special_tokens=False))
        n_out = len(tokenizer.encode(reply, add_special_tokens=False))
        if n_in < 4 or n_out < 4 or n_in > 1024 or n_in + n_out > 2048:
            continue
        requests.append(SampleRequest(prompt, n_in, n_out))
        if len(requests) == spec.num_prompts:
            return requests
    if not requests:
        raise ConfigError(f"{spec.dataset_path}: no conversation fits (prompt 4..1024 tokens, total <= 2048)")
    # fewer usable conversations than asked for: cycle through them, as a load test needs the count
    return [requests[i % len(requests)] for i in range(spec.num_prompts)]
