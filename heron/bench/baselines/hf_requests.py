"""Parse OpenAI completion and chat request bodies for the HF baseline into one GenRequest."""

from __future__ import annotations

from dataclasses import dataclass, field

from heron.errors import InvalidRequestError, PromptTooLongError


@dataclass
class GenRequest:
    """What the HF baseline needs to run one generation."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


def _number(body: dict, name: str, default, kind=float, low=None, high=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise InvalidRequestError(f"{name} must be {'an integer' if kind is int else 'a number'}", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise InvalidRequestError(f"{name} must be in [{low}, {high}], got {value}", param=name)
    return kind(value)


def _stop(body: dict) -> list[str]:
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequestError("stop must be a non-empty string or a list of them", param="stop")
    return stop


def _build(body: dict, prompt_ids: list[int], max_len: int, default_max: int | None) -> GenRequest:
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    room = max_len - len(prompt_ids)
    if room < 1:
        raise PromptTooLongError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {max_len}",
                                 param="prompt")
    max_tokens = _number(body, "max_tokens", None, int, low=1)
    max_tokens = _number(body, "max_completion_tokens", max_tokens, int, low=1)
    max_tokens = max_tokens if max_tokens is not None else min(default_max or room, room)
    if max_tokens > room:
        raise PromptTooLongError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                                 f"model's context of {max_len} tokens; lower max_tokens", param="max_tokens")
    if _number(body, "n", 1, int, low=1) != 1:
        raise InvalidRequestError("the HF baseline serves n=1 only", param="n")
    return GenRequest(prompt_ids, max_tokens,
                      temperature=_number(body, "temperature", 1.0, low=0.0, high=2.0),
                      top_p=_number(body, "top_p", 1.0, low=0.0, high=1.0),
                      top_k=_number(body, "top_k", -1, int),
                      ignore_eos=bool(body.get("ignore_eos", False)),
                      seed=_number(body, "seed", None, int), stop=_stop(body))


def parse_completion(body: dict, tokenizer, max_len: int) -> GenRequest:
    """A /v1/completions body: ``prompt`` is a string, a token-id list, or a one-element list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise InvalidRequestError("prompt must be a string or a list of token ids (one prompt per request)",
                                  param="prompt")
    return _build(body, ids, max_len, default_max=16)


def parse_chat(body: dict, tokenizer, max_len: int) -> GenRequest:
    """A /v1/chat/completions body: ``messages`` rendered with the model's chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise InvalidRequestError("messages must be a non-empty list of {role, content} strings", param="messages")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return _build(body, tokenizer.encode(text, add_special_tokens=False), max_len, default_max=None)
