"""Offline inference API, as vLLM's: ``LLM(model).generate(prompts, SamplingParams(...))``, and
``LLM(model, runner="pooling").embed(prompts)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from heron.config import DEFAULT_MODEL, EngineConfig
from heron.engine.engine import Engine
from heron.engine.outputs import EmbeddingRequestOutput, RequestOutput
from heron.model.generation_config import default_sampling_params
from heron.pooling_params import PoolingParams
from heron.sampling_params import RequestOutputKind, SamplingParams

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """Generates completions (or, with ``runner="pooling"``, embeddings) for a batch of prompts, all scheduled
    together by the engine."""

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: Any) -> None:
        config = EngineConfig(model=model, **engine_args)
        # read before the weights load, so that a bad ``generation_config`` fails at once
        self._default_sampling = default_sampling_params(config.model, config.generation_config)
        self.engine = Engine(config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters ``generate`` uses when given none: the model's generation-config defaults
        (see ``generation_config``) over SamplingParams' own, as vLLM's ``LLM.get_default_sampling_params``."""
        return SamplingParams(**self._default_sampling)

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Seq[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        A prompt is a string, a list of token ids, or ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}``.
        """
        prompts = self._as_list(prompts)
        params = self._per_prompt(sampling_params or self.get_default_sampling_params(), len(prompts))
        params = [p.clone(output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        return self._run(self._add_all(prompts, params, priority), use_tqdm)

    def embed(self, prompts: PromptType | Seq[PromptType],
              pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Embed every prompt with the engine's ``pooler_config`` (an engine started with ``runner="pooling"``);
        outputs come back in input order, each ``.outputs.embedding`` a list of floats."""
        prompts = self._as_list(prompts)
        params = self._per_prompt(pooling_params or PoolingParams(), len(prompts))
        return [EmbeddingRequestOutput.of(out) for out in self._run(self._add_all(prompts, params, None), use_tqdm)]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.engine.encode(
            self.engine.apply_chat_template(conv, add_generation_prompt), add_special_tokens=False)}
            for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    @staticmethod
    def _as_list(prompts: PromptType | Seq[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            return [prompts]
        return list(prompts)

    @staticmethod
    def _per_prompt(params: Any, num_prompts: int) -> list[Any]:
        """One parameters object per prompt: the sequence given, or the one given repeated."""
        params_list = list(params) if isinstance(params, Seq) else [params] * num_prompts
        if len(params_list) != num_prompts:
            raise ValueError(f"{num_prompts} prompts but {len(params_list)} parameter objects")
        return params_list

    def _add_all(self, prompts: list[PromptType], params: list[SamplingParams] | list[PoolingParams],
                 priority: Seq[int] | None) -> list[str]:
        """Queue every prompt; returns their request ids. A refused prompt refuses the batch: nothing stays
        queued."""
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, self._prompt(prompt), p, priority[i] if priority else 0)
                ids.append(request_id)
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            self.engine.step()
            raise
        return ids

    @staticmethod
    def _prompt(prompt: PromptType) -> str | list[int]:
        if isinstance(prompt, dict):
            return prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
        return prompt

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in request_ids]
