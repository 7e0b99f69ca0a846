"""Structured output with xgrammar: JSON schema, regex, choice, EBNF grammar and free JSON constraints.

``StructuredOutputCompiler.submit`` compiles a request's ``GuidedDecodingParams`` off the caller's thread and
returns a future of the compiled grammar (cached, LRU); each sequence follows it with its own ``GrammarState``.
A new constraint is compiled first in a child process (``grammar_worker.py``), so that a compiler crash or hang
fails that request only, then here, on a compile thread whose stack is larger than the child's. Each step the
sampler's ``GrammarMasker`` fills the token bitmasks of all constrained rows at once and masks their logits;
the engine feeds every sampled token back with ``GrammarState.accept_token`` and stops the sequence once
``is_terminated()``.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import xgrammar as xgr

from heron.errors import InvalidRequestError
from heron.sampling.grammar_worker import (
    COMPILE_TIMEOUT_S,
    WORKER_STACK_BYTES,
    CompilerCrashed,
    GrammarWorker,
    clean_error,
    compile_grammar,
)
from heron.sampling_params import GuidedDecodingParams

_CACHE_SIZE = 128
_STACK_BYTES = 4 * WORKER_STACK_BYTES  # what compiled in the child fits here, whatever the stack use around it
_NOUNS = {"guided_json": "schema", "guided_regex": "regex", "guided_grammar": "grammar",
          "guided_choice": "choice list", "response_format": "format"}

_Key = tuple[str, str, bool]  # (kind, spec, any_whitespace)


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
    """Compiles guided-decoding constraints against one tokenizer's vocabulary, one at a time, off the caller's
    thread."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int] | None = None,
                 timeout: float = COMPILE_TIMEOUT_S) -> None:
        stop_ids = list(eos_token_ids) if eos_token_ids else None
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.worker = GrammarWorker(info.serialize_json(), timeout)
        weakref.finalize(self, self.worker.close)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="heron-grammar")
        self._cache: OrderedDict[_Key, xgr.CompiledGrammar] = OrderedDict()
        self._pending: dict[_Key, Future] = {}
        self._lock = threading.Lock()

    def submit(self, guided: GuidedDecodingParams) -> Future:
        """A future of ``guided``'s ``xgr.CompiledGrammar`` (done at once if cached); it fails with
        InvalidRequestError for an invalid constraint, or one the compiler crashed or timed out on."""
        kind, spec, param = _describe(guided)
        key = (kind, spec, not guided.disable_any_whitespace)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                done: Future = Future()
                done.set_result(self._cache[key])
                return done
            if key not in self._pending:
                old = threading.stack_size(_STACK_BYTES)  # for the compile thread, started by the first job
                try:
                    self._pending[key] = self._thread.submit(self._compile, key, param)
                finally:
                    threading.stack_size(old)
            return self._pending[key]

    def _compile(self, key: _Key, param: str) -> xgr.CompiledGrammar:
        """On the compile thread: in the child first, then here; caches what compiled."""
        compiled = None
        try:
            compiled = self._compile_checked(key, param)
            return compiled
        finally:
            with self._lock:
                del self._pending[key]
                if compiled is not None:
                    self._cache[key] = compiled
                    if len(self._cache) > _CACHE_SIZE:
                        self._cache.popitem(last=False)

    def _compile_checked(self, key: _Key, param: str) -> xgr.CompiledGrammar:
        try:
            error = self.worker.check(*key)
        except CompilerCrashed as e:
            raise InvalidRequestError(f"the grammar compiler {e} on this {_NOUNS[param]}; simplify it",
                                      param=param) from None
        if error is None:
            try:
                return compile_grammar(self._compiler, *key)
            except RuntimeError as e:
                error = clean_error(e)
        raise InvalidRequestError(f"invalid {param}: {error}", param=param)


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
