"""Front-end side of the inputs: prompts to token ids, chat templates, and the checks that need a tokenizer.

Runs where the tokenizer lives (the API process, or beside an in-process core); the core re-checks what it
must (token ids, lengths) but never tokenizes.

Text is measured before it is tokenized: no token is longer than the vocabulary's longest entry, so a text of
more than ``max_model_len`` times that many characters cannot fit the context and is refused at once (a 20 MB
prompt would otherwise hold the tokenizer, and every request behind it, for seconds). The bound never refuses
a prompt that would fit.
"""

from __future__ import annotations

import time

from heron.engine.messages import CoreInfo, EngineCoreRequest
from heron.errors import InvalidRequestError, PromptTooLongError
from heron.pooling_params import PoolingParams
from heron.sampling_params import SamplingParams


class InputProcessor:
    """Tokenizes and validates requests against the loaded model's ``CoreInfo``."""

    def __init__(self, tokenizer, info: CoreInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info
        longest_token = max(map(len, tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = info.max_model_len * longest_token

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Render chat messages (and the tool definitions ``tools``, OpenAI's shape) with the model's (or
        ``--chat-template``'s) template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template; pass --chat-template or use completions")
        self.check_text_size(sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str)))
        extra = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **extra)

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``prompt`` (a list of ids is returned as is); refuses text too long to fit."""
        if isinstance(prompt, str):
            self.check_text_size(len(prompt))
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return list(prompt)

    def check_text_size(self, num_chars: int) -> None:
        """Raise PromptTooLongError if a prompt of ``num_chars`` characters cannot fit the context."""
        if num_chars > self.max_prompt_chars:
            raise PromptTooLongError(
                f"The prompt has {num_chars} characters, more than this model's maximum context length of "
                f"{self.info.max_model_len} tokens can hold ({self.max_prompt_chars} characters: "
                f"{self.max_prompt_chars // self.info.max_model_len} per token at most). Reduce the prompt.",
                param="prompt")

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams | PoolingParams,
                priority: int = 0, arrival_time: float | None = None, add_special_tokens: bool = True,
                max_tokens_must_fit: bool = False) -> EngineCoreRequest:
        """The core request for ``prompt`` (to generate from, or to pool with ``PoolingParams``); raises
        InvalidRequestError / PromptTooLongError.

        ``max_tokens_must_fit`` refuses a request whose prompt plus ``max_tokens`` exceeds the context (as
        vLLM's server does); otherwise such a request simply stops at the context length.
        """
        token_ids = self.encode(prompt, add_special_tokens)
        limit = self.info.max_model_len
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if isinstance(params, PoolingParams):
            return EngineCoreRequest(request_id, token_ids, None, priority, arrival_time or time.time(),
                                     pooling_params=params)
        n = len(token_ids)
        if max_tokens_must_fit and params.max_tokens is not None and n < limit < n + params.max_tokens:
            raise PromptTooLongError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} in the completion). "
                "Reduce the prompt or max_tokens.", param="max_tokens")
        params.update_from_tokenizer(self.tokenizer)
        params.verify_token_ids(self.info.vocab_size)
        return EngineCoreRequest(request_id, token_ids, params, priority, arrival_time or time.time())
