"""Pooling with vLLM's names: the engine's ``PoolerConfig`` (``--pooler-config``) and per-request
``PoolingParams``. An engine started with ``runner="pooling"`` turns each prompt into one vector instead of
generating text."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from heron.errors import ConfigError

POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass
class PoolerConfig:
    """How a pooling engine reduces a prompt's final hidden states to one vector: the last position's (LAST,
    the default for decoder models), their mean (MEAN) or the first position's (CLS); then L2-normalized
    unless ``normalize`` is false."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        self.pooling_type = str(self.pooling_type).upper()
        if self.pooling_type not in POOLING_TYPES:
            raise ConfigError(f"--pooler-config pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                              f"got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ConfigError(f"--pooler-config normalize must be true or false, got {self.normalize!r}")

    @classmethod
    def parse(cls, value: str | dict[str, Any] | PoolerConfig | None) -> PoolerConfig:
        """The config of a ``--pooler-config`` JSON object (or its dict); None gives the defaults."""
        if value is None or isinstance(value, PoolerConfig):
            return value or cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ConfigError(f"--pooler-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError('--pooler-config must be a JSON object such as {"pooling_type": "MEAN"}')
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(value) - known):
            raise ConfigError(f"--pooler-config: unsupported key(s) {', '.join(unknown)}; "
                              f"heron knows {', '.join(sorted(known))}")
        return cls(**value)


@dataclass
class PoolingParams:
    """Per-request pooling options; ``normalize=None`` takes the engine's ``PoolerConfig.normalize``."""

    normalize: bool | None = None
