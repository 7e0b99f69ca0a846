"""Sampling parameters with vLLM's names and semantics."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any

from heron.errors import InvalidRequestError

_GREEDY_EPS = 1e-5

# Bounds on a guided-decoding constraint, checked before any compiler sees it. xgrammar's compilers are native
# code that recurses over its input (a chain of 5,000 $refs, 475 KB, overflows its stack) and can take seconds
# (3,000 $refs: 7 s); real schemas stay far below (OpenAI's allow 10 levels of schema nesting, ~20 of JSON).
MAX_GUIDED_BYTES = 64 * 1024  # a schema as compact UTF-8 JSON, a regex, a grammar, or all choices together
MAX_GUIDED_DEPTH = 64  # nesting of objects and arrays in a schema; of parentheses in a regex or a grammar
MAX_SCHEMA_REFS = 1000  # "$ref" keys in a schema


@dataclass
class GuidedDecodingParams:
    """One structured-output constraint: exactly one of the fields is set, within the MAX_GUIDED_* bounds."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        n_set = sum(x is not None and x is not False for x in (self.json, self.regex, self.choice, self.grammar,
                                                               self.json_object))
        if n_set != 1:
            raise InvalidRequestError("exactly one of guided json, regex, choice, grammar, json_object must be set",
                                      param="guided_decoding")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise InvalidRequestError("guided_choice must be a non-empty list of strings", param="guided_choice")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except RecursionError:
                raise InvalidRequestError(f"guided_json nests deeper than {MAX_GUIDED_DEPTH} levels",
                                          param="guided_json") from None
            except ValueError as e:
                raise InvalidRequestError(f"guided_json is not valid JSON: {e}", param="guided_json") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise InvalidRequestError("guided_json must be a JSON schema object", param="guided_json")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"guided_{name} must be a non-empty string", param=f"guided_{name}")
        self._check_bounds()

    def _check_bounds(self) -> None:
        """Refuse a constraint larger or deeper than the MAX_GUIDED_* bounds."""
        if self.json is not None:
            param, (depth, refs) = "guided_json", _json_shape(self.json)
            if refs > MAX_SCHEMA_REFS:
                raise InvalidRequestError(f"guided_json has {refs} $refs; the limit is {MAX_SCHEMA_REFS}",
                                          param=param)
            try:  # only once the depth is known to be bounded: json.dumps recurses
                text = "" if depth > MAX_GUIDED_DEPTH else json.dumps(self.json, ensure_ascii=False,
                                                                       separators=(",", ":"))
            except (TypeError, ValueError) as e:
                raise InvalidRequestError(f"guided_json is not JSON: {e}", param=param) from None
        elif self.choice is not None:
            param, text, depth = "guided_choice", "".join(self.choice), 0
        elif self.regex is not None or self.grammar is not None:
            param = "guided_regex" if self.regex is not None else "guided_grammar"
            text = self.regex if self.regex is not None else self.grammar
            depth = _paren_depth(text, quoted=self.grammar is not None)
        else:
            return
        if depth > MAX_GUIDED_DEPTH:
            raise InvalidRequestError(f"{param} nests deeper than {MAX_GUIDED_DEPTH} levels", param=param)
        if (size := len(text.encode())) > MAX_GUIDED_BYTES:
            raise InvalidRequestError(f"{param} is {size} bytes; the limit is {MAX_GUIDED_BYTES}", param=param)


def _json_shape(value: Any) -> tuple[int, int]:
    """(nesting depth, number of "$ref" keys) of a JSON value, walked without recursion."""
    depth = refs = 0
    stack = [(value, 1)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, dict):
            refs += "$ref" in value
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        depth = max(depth, level)
        stack.extend((child, level + 1) for child in children)
    return depth, refs


def _paren_depth(text: str, quoted: bool) -> int:
    """Deepest nesting of parentheses in a regex or grammar, skipping escapes, character classes and (``quoted``)
    string literals."""
    depth = deepest = 0
    in_class = in_string = escaped = False
    for c in text:
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif in_string:
            in_string = c != '"'
        elif in_class:
            in_class = c != "]"
        elif c == '"' and quoted:
            in_string = True
        elif c == "[":
            in_class = True
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
    return deepest


class RequestOutputKind(IntEnum):
    """What each output of a request carries (vLLM's names): everything so far, only what is new, or
    one output at the end."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to sample one request's output; ``temperature=0`` means greedy."""

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    guided_decoding: GuidedDecodingParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra: dict[str, Any] = field(default_factory=dict)
    # Token ids of each bad word (with and without a leading space); set by update_from_tokenizer.
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.best_of is None:
            self.best_of = self.n
        if self.top_k == 0:
            self.top_k = -1
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise InvalidRequestError("logit_bias must map token ids to numbers", param="logit_bias") from None
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str, param: str) -> None:
            raise InvalidRequestError(msg, param=param)

        def is_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        for name in ("n", "best_of", "top_k", "min_tokens"):
            if not is_int(getattr(self, name)):
                bad(f"{name} must be an integer, got {getattr(self, name)!r}", name)
        for name in ("max_tokens", "logprobs", "prompt_logprobs", "seed"):
            value = getattr(self, name)
            if value is not None and not is_int(value):
                bad(f"{name} must be an integer or None, got {value!r}", name)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                bad(f"{name} must be a finite number, got {value!r}", name)
        if not all(math.isfinite(v) for v in (self.logit_bias or {}).values()):
            bad("logit_bias values must be finite numbers", "logit_bias")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:
            bad(f"seed must be in [-2**63, 2**64), got {self.seed}", "seed")
        if self.n < 1:
            bad(f"n must be at least 1, got {self.n}", "n")
        if self.best_of < self.n:
            bad(f"best_of must be >= n, got best_of={self.best_of}, n={self.n}", "best_of")
        if self.temperature < 0:
            bad(f"temperature must be non-negative, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            bad(f"top_k must be -1 (disable), or at least 1, got {self.top_k}", "top_k")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if not -2 <= self.presence_penalty <= 2:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}", "presence_penalty")
        if not -2 <= self.frequency_penalty <= 2:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}", "frequency_penalty")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}", "repetition_penalty")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.min_tokens < 0:
            bad(f"min_tokens must be non-negative, got {self.min_tokens}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})", "min_tokens")
        if self.logprobs is not None and self.logprobs < 0:
            bad(f"logprobs must be non-negative, got {self.logprobs}", "logprobs")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}", "prompt_logprobs")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop strings must be non-empty strings", "stop")
        if not all(isinstance(w, str) and w.strip() for w in self.bad_words or []):
            bad("bad_words must be non-empty strings", "bad_words")
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if ids is not None and not all(is_int(t) for t in ids):
                bad(f"{name} must be a list of integer token ids", name)
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            bad("allowed_token_ids must not be empty", "allowed_token_ids")
        if self.guided_decoding is not None and not isinstance(self.guided_decoding, GuidedDecodingParams):
            bad("guided_decoding must be a GuidedDecodingParams", "guided_decoding")

    def verify_token_ids(self, vocab_size: int) -> None:
        """Check that every token id the parameters name exists in a vocabulary of ``vocab_size``."""
        named = {
            "stop_token_ids": self.stop_token_ids,
            "allowed_token_ids": self.allowed_token_ids or [],
            "logit_bias": list(self.logit_bias or {}),
            "bad_words": [t for ids in self.bad_words_token_ids or [] for t in ids],
        }
        for param, ids in named.items():
            for t in ids:
                if not 0 <= t < vocab_size:
                    raise InvalidRequestError(f"token id {t} in {param} is out of vocabulary [0, {vocab_size})",
                                              param=param)
        for param in ("logprobs", "prompt_logprobs"):
            if (getattr(self, param) or 0) > vocab_size:
                raise InvalidRequestError(f"{param} must be at most the vocabulary size {vocab_size}", param=param)

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize ``bad_words`` (as vLLM: alone and after a space) into ``bad_words_token_ids``."""
        if not self.bad_words:
            return
        token_ids: list[list[int]] = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            token_ids.append(plain)
            # the spaced form counts when it is a different word token of the same length, as in vLLM
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                token_ids.append(spaced)
        self.bad_words_token_ids = token_ids

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` applied (validated again)."""
        return replace(self, **changes)
