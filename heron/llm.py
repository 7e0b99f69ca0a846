"""Offline inference API, as vLLM's: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from heron.config import DEFAULT_MODEL, EngineConfig
from heron.engine.engine import Engine
from heron.engine.outputs import RequestOutput
from heron.sampling_params import RequestOutputKind, SamplingParams

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """Generates completions for a batch of prompts, all scheduled together by the engine."""

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: Any) -> None:
        self.engine = Engine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Seq[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        A prompt is a string, a list of token ids, or ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}``.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Seq) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
                request_id = str(next(self._ids))
                p = p.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                self.engine.add_request(request_id, self._prompt(prompt), p, priority[i] if priority else 0)
                ids.append(request_id)
        except BaseException:
            for request_id in ids:  # a refused prompt refuses the batch: nothing stays queued
                self.engine.abort_request(request_id)
            self.engine.step()
            raise
        return self._run(ids, use_tqdm)

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
