"""Front-end side of the inputs: prompts to token ids, chat templates, and the checks that need a tokenizer.

Runs where the tokenizer lives (the API process, or beside an in-process core); the core re-checks what it
must (token ids, lengths) but never tokenizes.
"""

from __future__ import annotations

import time

from heron.engine.messages import CoreInfo, EngineCoreRequest
from heron.errors import InvalidRequestError, PromptTooLongError
from heron.sampling_params import SamplingParams


class InputProcessor:
    """Tokenizes and validates requests against the loaded model's ``CoreInfo``."""

    def __init__(self, tokenizer, info: CoreInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render chat messages with the model's (or ``--chat-template``'s) template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template; pass --chat-template or use completions")
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return list(prompt)

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0,
                arrival_time: float | None = None, add_special_tokens: bool = True,
                max_tokens_must_fit: bool = False) -> EngineCoreRequest:
        """The core request for ``prompt``; raises InvalidRequestError / PromptTooLongError.

        ``max_tokens_must_fit`` refuses a request whose prompt plus ``max_tokens`` exceeds the context (as
        vLLM's server does); otherwise such a request simply stops at the context length.
        """
        token_ids = self.encode(prompt, add_special_tokens)
        limit = self.info.max_model_len
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        n = len(token_ids)
        if max_tokens_must_fit and params.max_tokens is not None and n < limit < n + params.max_tokens:
            raise PromptTooLongError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} in the completion). "
                "Reduce the prompt or max_tokens.", param="max_tokens")
        params.update_from_tokenizer(self.tokenizer)
        params.verify_token_ids(self.info.vocab_size)
        return EngineCoreRequest(request_id, token_ids, params, priority, arrival_time or time.time())
