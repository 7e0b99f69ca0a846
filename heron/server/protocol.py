"""OpenAI request and response models (plus vLLM's extra sampling fields), and their mapping to SamplingParams.

Request models refuse at the edge, as a 400, what would otherwise fail deep inside: text that is not valid
Unicode (a lone surrogate such as ``"\\ud800"``, which JSON can carry but UTF-8 cannot), non-finite floats
(``NaN``, ``Infinity``, ``1e400``), and integers outside the 64-bit range the engine's messages carry.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from heron.errors import InvalidRequestError
from heron.sampling_params import GuidedDecodingParams, SamplingParams

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range; larger biases are clamped to it, as vLLM does

# fields a model's generation config may give defaults for (heron/model/generation_config.py), max_tokens aside
MODEL_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

Int64 = Annotated[int, Field(ge=-2**63, lt=2**63)]
Seed = Annotated[int, Field(ge=-2**63, lt=2**64)]  # SamplingParams' range: signed or unsigned 64-bit


def _check_text(value: Any) -> None:
    """Raise ValueError if ``value`` holds a string that cannot be encoded as UTF-8 (a lone surrogate)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"text is not valid Unicode: lone surrogate {value[e.start]!r} at position "
                             f"{e.start}") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key)
            _check_text(item)
    elif isinstance(value, list):
        for item in value:
            if not isinstance(item, int | float):  # token-id lists can be long: skip their items cheaply
                _check_text(item)


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _encodable(cls, value: Any) -> Any:
        _check_text(value)
        return value


class StreamOptions(_Model):
    include_usage: bool = False


class JsonSchema(_Model):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class _SamplingRequest(_Model):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: Int64 = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Seed | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM extras
    best_of: Int64 | None = None
    top_k: Int64 | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: Int64 = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[Int64] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    priority: Int64 = 0

    def _guided(self) -> GuidedDecodingParams | None:
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            return GuidedDecodingParams(json_object=True)
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise InvalidRequestError("response_format json_schema needs json_schema.schema",
                                          param="response_format")
            return GuidedDecodingParams(json=fmt.json_schema.schema_)
        guided = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        guided = {k: v for k, v in guided.items() if v is not None}
        if not guided:
            return None
        if isinstance(guided.get("json"), str):
            try:
                guided["json"] = json.loads(guided["json"])
                _check_text(guided["json"])
            except ValueError as e:
                raise InvalidRequestError(f"guided_json is not valid JSON: {e}", param="guided_json") from e
        return GuidedDecodingParams(**guided)

    def _or_default(self, name: str, defaults: Mapping[str, Any]) -> Any:
        """The request's ``name``; where the request is silent on it (left out or null), the model's default
        if ``defaults`` has one."""
        value = getattr(self, name)
        if (name not in self.model_fields_set or value is None) and name in defaults:
            return defaults[name]
        return value

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: Mapping[str, Any],
                         logprobs_field: str = "logprobs", **extra: Any) -> SamplingParams:
        if logprobs is not None and logprobs > MAX_LOGPROBS:
            raise InvalidRequestError(f"{logprobs_field} must be at most {MAX_LOGPROBS}, got {logprobs}",
                                      param=logprobs_field)
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, v))
                        for k, v in self.logit_bias.items()}
            except ValueError as e:
                raise InvalidRequestError("logit_bias keys must be token ids (integers as strings)",
                                          param="logit_bias") from e
        sampling = {name: self._or_default(name, defaults) for name in MODEL_DEFAULTED}
        return SamplingParams(
            n=self.n, best_of=self.best_of, **{k: v for k, v in sampling.items() if v is not None},
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, bad_words=self.bad_words, ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, logit_bias=bias,
            allowed_token_ids=self.allowed_token_ids, guided_decoding=self._guided(), **extra)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[Int64] | list[list[Int64]]
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            p = [p]
        if not p or any(len(x) == 0 for x in p):
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        return list(p)

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """The request's SamplingParams; ``defaults`` (the model's generation config) fill the fields it is
        silent on."""
        if self.suffix is not None:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        defaults = defaults or {}
        extra = {"prompt_logprobs": self.logprobs} if self.echo and self.logprobs is not None else {}
        return self._sampling_params(self._or_default("max_tokens", defaults), self.logprobs, defaults, **extra)


class ContentPart(_Model):
    type: Literal["text"]
    text: str


class FunctionCall(_Model):
    name: str
    arguments: str  # JSON text


class ChatToolCall(_Model):
    """A call an assistant made: in a response, and in the history a request sends back."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDefinition(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: FunctionName


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ChatToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this answers

    @model_validator(mode="after")
    def _tool_fields_fit_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages have tool_calls, not {self.role} messages")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"only tool messages have a tool_call_id, not {self.role} messages")
        return self

    def to_dict(self) -> dict[str, Any]:
        """The message as chat templates take it (HF's convention: tool-call arguments as a dict)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        msg: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


def _arguments(text: str) -> dict[str, Any] | str:
    """Arguments as templates render them (``tool_call.arguments | tojson``): the object, if ``text`` is one
    (as vLLM does); else the text as it is."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """The request's SamplingParams; ``defaults`` (the model's generation config) fill the fields it is
        silent on."""
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        defaults = defaults or {}
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = (self.max_completion_tokens if self.max_completion_tokens is not None
                      else self._or_default("max_tokens", defaults))
        return self._sampling_params(max_tokens, logprobs, defaults, "top_logprobs")


class TokenizeRequest(_Model):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[Int64]


# ---- responses ----


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ChatToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "heron"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


# ---- embeddings and pooling (--runner pooling) ----


class EmbeddingRequest(_Model):
    """OpenAI's embeddings request (also vLLM's ``/pooling``), plus vLLM's extra fields."""

    model: str | None = None
    input: str | list[str] | list[Int64] | list[list[Int64]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None
    user: str | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None  # None: the server's --pooler-config
    priority: Int64 = 0

    def inputs(self) -> list[str | list[int]]:
        """The request's inputs, each a string or a list of token ids."""
        x = self.input
        if isinstance(x, str) or (x and isinstance(x[0], int)):
            x = [x]
        if not x or any(len(i) == 0 for i in x):
            raise InvalidRequestError("input must not be empty (nor hold an empty string or list)", param="input")
        return list(x)


class EmbeddingData(BaseModel):
    index: int
    object: str = "embedding"
    embedding: list[float] | str  # a string when encoding_format is base64


class PoolingData(BaseModel):
    index: int
    object: str = "pooling"
    data: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData] | list[PoolingData]
    usage: EmbeddingUsage
