"""Front-end side of the outputs: core deltas in, ``RequestOutput``s out.

Per request it keeps each sample's detokenizer, text and tokens; it finds stop strings (token by token, so a
run of several accepted tokens is cut exactly where one-at-a-time decoding would cut it), holds back text
that may still grow into one, turns logprobs into vLLM's ``dict[int, Logprob]`` form, and emits outputs of
the kind the request asked for: cumulative, delta, or final only. Work per step is proportional to the new
tokens, except for ``CUMULATIVE`` outputs, which copy what the caller asked to see. A pooling request has
nothing to detokenize: its one output carries its vector.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from heron.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from heron.engine.messages import EngineCoreOutput
from heron.engine.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput
from heron.pooling_params import PoolingParams
from heron.sampling.sampler import TokenLogprobs
from heron.sampling_params import RequestOutputKind, SamplingParams


class TokenTexts:
    """``decoded_token`` strings of logprobs, cached per token id."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text

    def logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        """The sampled (or scored) token first, then the top alternatives by rank."""
        entries = {lp.token_id: Logprob(lp.logprob, lp.rank, self(lp.token_id))}
        for rank, (token_id, value) in enumerate(lp.top, start=1):
            entries.setdefault(token_id, Logprob(value, rank, self(token_id)))
        return entries


@dataclass
class SampleState:
    """One sample's output so far and what has already been emitted of it."""

    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_text: int = 0
    sent_logprobs: int = 0


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    samples: dict[int, SampleState] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        done = [s for s in self.samples.values() if s.finish_reason is not None]
        return len(done) == self.params.n or any(s.finish_reason in ("abort", "error") for s in done)


@dataclass
class PoolingRequestState:
    """A pooling request in the front end: the core sends it one output, when it ends."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics

    def output(self, out: EngineCoreOutput, now: float) -> RequestOutput:
        """The request's final output: its vector, or how it failed."""
        self.metrics.first_scheduled_time = self.metrics.first_scheduled_time or now
        self.metrics.finished_time = now
        pooled = None if out.pooled is None else np.frombuffer(out.pooled, dtype="<f4").tolist()
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [CompletionOutput(0, "", [], finish_reason=out.finish_reason)], True, self.metrics,
                             num_cached_tokens=out.num_cached_tokens, error=out.error, pooled=pooled)


class OutputProcessor:
    """Turns ``EngineCoreOutput`` deltas into ``RequestOutput``s; owns the front end's per-request state."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.texts = TokenTexts(tokenizer)
        self.requests: dict[str, RequestState] = {}
        self.pooling: dict[str, PoolingRequestState] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams | PoolingParams, arrival_time: float) -> None:
        if isinstance(params, PoolingParams):
            self.pooling[request_id] = PoolingRequestState(request_id, prompt, prompt_token_ids,
                                                    RequestMetrics(arrival_time))
            return
        self.requests[request_id] = RequestState(request_id, prompt, prompt_token_ids, params,
                                                 RequestMetrics(arrival_time))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Forget a request; returns its final output (finish_reason "abort") if it was still running."""
        pooling = self.pooling.pop(request_id, None)
        if pooling is not None:
            return pooling.output(EngineCoreOutput(request_id, finish_reason="abort"), time.time())
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for i in range(state.params.n):
            sample = self._sample(state, i)
            if sample.finish_reason is None:
                sample.finish_reason = "abort"
        state.metrics.finished_time = time.time()
        return self._output(state, force=True)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """Apply one step's deltas. Returns the outputs to hand out and the samples that a stop string ended
        (to stop in the core)."""
        now = time.time()
        touched: dict[str, RequestState] = {}
        stopped: list[tuple[str, int]] = []
        results = []
        for out in outputs:
            pooling = self.pooling.pop(out.request_id, None)
            if pooling is not None:
                results.append(pooling.output(out, now))
                continue
            state = self.requests.get(out.request_id)
            if state is None:
                continue  # aborted in the front end while the core was still stepping
            touched[out.request_id] = state
            state.metrics.first_scheduled_time = state.metrics.first_scheduled_time or now
            state.num_cached_tokens = out.num_cached_tokens
            if out.new_prompt_logprobs:
                self._add_prompt_logprobs(state, out.new_prompt_logprobs)
            if out.error is not None:
                state.error = out.error
            if self._apply(state, out, now):
                stopped.append((out.request_id, out.index))
        for state in touched.values():
            if state.finished:
                state.metrics.finished_time = now
                del self.requests[state.request_id]
            result = self._output(state)
            if result is not None:
                results.append(result)
        return results, stopped

    def _sample(self, state: RequestState, index: int) -> SampleState:
        sample = state.samples.get(index)
        if sample is None:
            p = state.params
            detok = IncrementalDetokenizer.for_prompt(self.tokenizer, state.prompt_token_ids, p.skip_special_tokens,
                                                      p.spaces_between_special_tokens)
            sample = state.samples[index] = SampleState(index, detok, logprobs=[] if p.logprobs is not None else None)
        return sample

    def _apply(self, state: RequestState, out: EngineCoreOutput, now: float) -> bool:
        """Add one sample's new tokens, one at a time; True if a stop string ended it here."""
        sample = self._sample(state, out.index)
        if sample.finish_reason is not None:
            return False  # tokens the core produced before it learnt of a stop string
        p = state.params
        if out.new_token_ids:
            state.metrics.first_token_time = state.metrics.first_token_time or now
            state.metrics.last_token_time = now
        last = len(out.new_token_ids) - 1
        for j, token in enumerate(out.new_token_ids):
            sample.token_ids.append(token)
            if sample.logprobs is not None and out.new_logprobs:
                lp = out.new_logprobs[j]
                sample.logprobs.append(self.texts.logprob_dict(lp))
                sample.cumulative_logprob += lp.logprob
            # a sample the core stopped ended on a stop token (EOS, a stop id, or the one a grammar ends on): its
            # text is not output, even with skip_special_tokens off (as vLLM)
            stop_token = (j == last and out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
                          and not p.include_stop_str_in_output)
            new_text = "" if stop_token else sample.detok.append(token)
            sample.text += new_text
            if new_text and p.stop and len(sample.token_ids) >= p.min_tokens:
                found = find_stop_string(sample.text, len(new_text), p.stop)
                if found:
                    stop, idx = found
                    sample.text = sample.text[: idx + (len(stop) if p.include_stop_str_in_output else 0)]
                    sample.finish_reason, sample.stop_reason = "stop", stop
                    return True
        if out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
        return False

    def _add_prompt_logprobs(self, state: RequestState, lps: list[TokenLogprobs]) -> None:
        if state.prompt_logprobs is None:
            state.prompt_logprobs = [None]
        state.prompt_logprobs.extend(self.texts.logprob_dict(lp) for lp in lps)

    def _output(self, state: RequestState, force: bool = False) -> RequestOutput | None:
        kind = state.params.output_kind
        finished = state.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        outs = [self._completion(state, self._sample(state, i), delta) for i in sorted(state.samples)]
        if not outs and not force and not finished:
            return None
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outs, finished, state.metrics,
                             state.prompt_logprobs, state.num_cached_tokens, state.error)

    @staticmethod
    def _completion(state: RequestState, s: SampleState, delta: bool) -> CompletionOutput:
        text = s.text
        p = state.params
        if s.finish_reason is None and p.stop:  # hold back what might still become a stop string
            hold = max(len(x) for x in p.stop) - 1
            text = text[: max(len(text) - hold, s.sent_text)] if hold else text
        want_lp = p.logprobs is not None
        if delta:
            out = CompletionOutput(s.index, text[s.sent_text:], s.token_ids[s.sent_tokens:],
                                   s.cumulative_logprob if want_lp else None,
                                   s.logprobs[s.sent_logprobs:] if want_lp else None, s.finish_reason, s.stop_reason)
        else:
            out = CompletionOutput(s.index, text, list(s.token_ids), s.cumulative_logprob if want_lp else None,
                                   list(s.logprobs) if want_lp else None, s.finish_reason, s.stop_reason)
        s.sent_text, s.sent_tokens = len(text), len(s.token_ids)
        s.sent_logprobs = len(s.logprobs) if s.logprobs is not None else 0
        return out
