"""``--speculative-config`` as vLLM reads it, plus the older ``--speculative-model`` / ``--num-speculative-tokens``.

Methods: ``ngram`` (prompt lookup), ``draft_model`` (a second, smaller model with the target's vocabulary) and
``self_draft`` (the target itself in a cheaper form: ``draft_layers`` of its layers, the middle ones skipped, with
its embedding, final norm and head, sharing the target's weights and KV cache; or, with ``quantization``, a
quantized copy of the target).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from heron.errors import ConfigError

METHODS = ("ngram", "draft_model", "self_draft")
REJECTION_METHODS = ("strict", "probabilistic")
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class SpeculativeConfig:
    """How an engine speculates; ``parse`` builds it from the engine's flags (None: no speculation)."""

    method: str
    num_speculative_tokens: int | None = None  # required: refused by ``validate`` when missing
    model: str | None = None  # draft_model: the draft's path (anything heron loads)
    quantization: str | None = None  # draft_model / self_draft: the draft's weight format
    draft_layers: int | list[int] | None = None  # self_draft: how many of the target's layers (middle ones skipped), or which
    prompt_lookup_min: int | None = None  # ngram: shortest suffix matched
    prompt_lookup_max: int | None = None  # ngram: longest suffix matched
    # strict: accept a draft when the target's own sample equals it (lossless for any proposer);
    # probabilistic: Leviathan et al.'s min(1, p/q) test, higher acceptance for a sampled draft model
    rejection_sample_method: str = "probabilistic"
    disable_by_batch_size: int | None = None  # speculation off from this many running sequences (else the cost model)
    min_acceptance_rate: float = 0.1  # a request whose drafts are accepted less often than this stops speculating

    @classmethod
    def parse(cls, spec: str | dict | None, model: str | None = None,
              num_tokens: int | None = None) -> SpeculativeConfig | None:
        """Build from ``--speculative-config`` (JSON or a dict) and/or the older flags; None when neither asks."""
        if isinstance(spec, str):
            try:
                spec = json.loads(spec) if spec.strip() else None
            except json.JSONDecodeError as e:
                raise ConfigError(f"--speculative-config is not valid JSON: {e}") from None
        if spec is not None and not isinstance(spec, dict):
            raise ConfigError("--speculative-config must be a JSON object")
        values: dict[str, Any] = dict(spec or {})
        if model is not None:
            values.setdefault("model", model)
        if num_tokens is not None:
            values.setdefault("num_speculative_tokens", num_tokens)
        if not values:
            return None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"--speculative-config: unknown key(s) {', '.join(unknown)}; known: "
                              f"{', '.join(sorted(known))}")
        if values.get("model") == "[ngram]":  # vLLM's older spelling
            values.pop("model")
            values.setdefault("method", "ngram")
        if "method" not in values:
            if not values.get("model"):
                raise ConfigError('speculative decoding needs a "method" (ngram, draft_model, self_draft) or a draft '
                                  "model (--speculative-model)")
            values["method"] = "draft_model"
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        """Reject values heron cannot honour, with what to do instead; fill vLLM's n-gram defaults."""
        if self.method not in METHODS:
            raise ConfigError(f"speculative method {self.method!r} is not supported; use one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if k is None:
            raise ConfigError("speculative decoding needs num_speculative_tokens (--num-speculative-tokens)")
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.rejection_sample_method not in REJECTION_METHODS:
            raise ConfigError(f"rejection_sample_method must be one of {', '.join(REJECTION_METHODS)}")
        if self.method == "draft_model" and not self.model:
            raise ConfigError('method "draft_model" needs "model": the draft\'s path')
        if self.method == "ngram":
            # vLLM: both default to 5, and one given stands for the other
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            self.prompt_lookup_min = lo if lo is not None else (hi if hi is not None else 5)
            self.prompt_lookup_max = hi if hi is not None else self.prompt_lookup_min
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise ConfigError("prompt_lookup_min must be >= 1 and <= prompt_lookup_max, got "
                                  f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.draft_layers is not None and self.method != "self_draft":
            raise ConfigError('draft_layers applies to method "self_draft" only')
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ConfigError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        if not 0 <= self.min_acceptance_rate < 1:
            raise ConfigError(f"min_acceptance_rate must be in [0, 1), got {self.min_acceptance_rate}")
