"""The synchronous engine: front end (tokenizer, output processor) over an in-process ``EngineCore``.

``LLM`` and ``heron generate`` drive it; the server runs the same core in its own process instead
(``engine/core_client.py``). Not thread-safe: drive it from one thread.
"""

from __future__ import annotations

from heron.config import EngineConfig
from heron.cpu import set_engine_threads
from heron.engine.core import EngineCore
from heron.engine.output_processor import OutputProcessor
from heron.engine.outputs import EngineStats, RequestOutput
from heron.engine.processor import InputProcessor
from heron.pooling_params import PoolingParams
from heron.sampling_params import SamplingParams


class Engine:
    """Adds requests, steps the core, and returns ``RequestOutput``s of the kind each request asked for."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        set_engine_threads(config.cpu_threads, serving=False, ranks=config.tensor_parallel_size)
        self.core = EngineCore(config)
        self.tokenizer = self.core.tokenizer
        self.info = self.core.info
        self.processor = InputProcessor(self.tokenizer, self.info)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._aborted: list[RequestOutput] = []

    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render chat messages with the model's (or ``--chat-template``'s) template."""
        return self.processor.apply_chat_template(messages, add_generation_prompt)

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        return self.processor.encode(prompt, add_special_tokens)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | PoolingParams,
                    priority: int = 0, arrival_time: float | None = None, add_special_tokens: bool = True,
                    max_tokens_must_fit: bool = False) -> None:
        """Validate and queue a request (to generate from, or to pool with ``PoolingParams``); raises
        InvalidRequestError/PromptTooLongError before queueing."""
        request = self.processor.process(request_id, prompt, params, priority, arrival_time, add_special_tokens,
                                         max_tokens_must_fit)
        self.core.add_request(request, wait_for_grammar=True)  # a grammar's errors surface here, not later
        self.output_processor.add(request_id, prompt if isinstance(prompt, str) else None,
                                  request.prompt_token_ids, params, request.arrival_time)

    def abort_request(self, request_id: str) -> None:
        """Stop a request wherever it is and free its blocks now; its final output comes with the next step."""
        self.core.abort_requests([request_id])
        final = self.output_processor.abort(request_id)
        if final is not None:
            self._aborted.append(final)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or bool(self._aborted)

    def step(self) -> list[RequestOutput]:
        """Run one core step; returns the outputs of every request that progressed or ended."""
        outputs, self._aborted = self._aborted, []
        results, stopped = self.output_processor.process(self.core.step())
        self.core.stop_samples(stopped)
        return outputs + results

    def stats(self) -> EngineStats:
        return self.core.stats()

    def shutdown(self) -> None:
        """Stop the engine's other tensor-parallel ranks, if any; the engine cannot step afterwards."""
        self.core.shutdown()
