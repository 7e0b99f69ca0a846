"""Structured output with xgrammar: JSON schema, regex, choice, EBNF grammar and free JSON constraints.

``StructuredOutputCompiler.compile`` turns a request's ``GuidedDecodingParams`` into a ``GrammarState`` (one
per sequence); compiled grammars are cached. Each step the sampler's ``GrammarMasker`` fills the token
bitmasks of all constrained rows at once and masks their logits; the engine feeds every sampled token back
with ``GrammarState.accept_token`` and stops the sequence once ``is_terminated()``.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

from heron.errors import InvalidRequestError
from heron.sampling_params import GuidedDecodingParams

_CACHE_SIZE = 128
# xgrammar's C++ errors start with "[hh:mm:ss] file.cc:line: " and sometimes "Check failed: (...) is false: "
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class GrammarState:
    """Where one sequence stands in its grammar: which tokens may come next, and whether it has finished."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)

    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (and no change) if the grammar does not allow it."""
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        """Whether the grammar has accepted a stop token (the output is complete)."""
        return self.matcher.is_terminated()


class StructuredOutputCompiler:
    """Compiles guided-decoding constraints against one tokenizer and vocabulary."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int] | None = None) -> None:
        stop_ids = list(eos_token_ids) if eos_token_ids else None
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self._compile_cached = functools.lru_cache(maxsize=_CACHE_SIZE)(self._compile)

    def compile(self, guided: GuidedDecodingParams) -> GrammarState:
        """A fresh ``GrammarState`` for ``guided``; raises InvalidRequestError for an invalid schema/regex/grammar."""
        kind, spec, param = _describe(guided)
        try:
            compiled = self._compile_cached(kind, spec, not guided.disable_any_whitespace)
        except RuntimeError as e:
            raise InvalidRequestError(f"invalid {param}: {_clean_error(e)}", param=param) from None
        return GrammarState(compiled)

    def _compile(self, kind: str, spec: str, any_whitespace: bool) -> xgr.CompiledGrammar:
        if kind == "json":
            return self._compiler.compile_json_schema(spec, any_whitespace=any_whitespace)
        if kind == "json_object":
            return self._compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return self._compiler.compile_regex(spec)
        return self._compiler.compile_grammar(spec)


class GrammarMasker:
    """Masks, in one batched call, the logits of every row whose sequence follows a grammar."""

    def __init__(self) -> None:
        self._batch_matcher = xgr.BatchGrammarMatcher()

    def apply(self, logits: torch.Tensor, grammars: Sequence[GrammarState | None]) -> None:
        """Set to -inf the logits of tokens each row's grammar forbids next; rows without a grammar are kept."""
        indices = [i for i, g in enumerate(grammars) if g is not None and not g.is_terminated()]
        if not indices:
            return
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
        self._batch_matcher.batch_fill_next_token_bitmask([grammars[i].matcher for i in indices], bitmask, indices)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=indices)


def _describe(guided: GuidedDecodingParams) -> tuple[str, str, str]:
    """(kind, hashable spec, request field name) of the one constraint ``guided`` sets."""
    if guided.json is not None:
        return "json", json.dumps(guided.json), "guided_json"
    if guided.json_object:
        return "json_object", "", "response_format"
    if guided.regex is not None:
        return "regex", guided.regex, "guided_regex"
    if guided.choice is not None:
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in guided.choice)
        return "grammar", f"root ::= {alternatives}", "guided_choice"
    return "grammar", guided.grammar, "guided_grammar"


def _clean_error(error: Exception) -> str:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return _XGR_PREFIX.sub("", first)
