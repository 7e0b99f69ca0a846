"""What the front end and the engine core say to each other: small, serializable, token ids only.

The core receives ``EngineCoreRequest``s and aborts, and answers each step with ``EngineCoreOutput`` deltas
(new token ids and logprobs of one sample, and how it ended; a pooling request's one output carries its vector
instead). The same messages serve an in-process core (``LLM``) and a core in its own process (the server),
where msgspec encodes them.
"""

from __future__ import annotations

import msgspec

from heron.engine.outputs import EngineStats
from heron.pooling_params import PoolingParams
from heron.sampling.sampler import TokenLogprobs
from heron.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    """A tokenized, validated request: to generate from (``sampling_params``) or to pool (``pooling_params``)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None
    priority: int = 0
    arrival_time: float = 0.0
    pooling_params: PoolingParams | None = None


class EngineCoreOutput(msgspec.Struct, omit_defaults=True):
    """What one sample of a request produced in one step (deltas, not cumulative)."""

    request_id: str
    index: int = 0
    new_token_ids: list[int] = []
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # why the request failed, when finish_reason is "error"
    pooled: bytes | None = None  # a pooling request's vector, little-endian float32, in its final output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestRejection(msgspec.Struct):
    """An add the core refused: the error's class name, message and offending parameter."""

    request_id: str
    kind: str
    message: str
    param: str | None = None


class CoreInfo(msgspec.Struct):
    """Facts about the loaded model that the front end needs to validate and detokenize."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_blocks: int
    block_size: int


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    """Everything one core iteration reports to the front end."""

    outputs: list[EngineCoreOutput] = []
    admitted: list[str] = []
    rejected: list[RequestRejection] = []
    stats: EngineStats | None = None
