"""heron: an LLM inference and serving engine with a paged KV cache and continuous batching."""

__version__ = "0.1.0"

from heron.llm import LLM  # noqa: E402
from heron.pooling_params import PoolingParams  # noqa: E402
from heron.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "PoolingParams", "SamplingParams", "__version__"]
