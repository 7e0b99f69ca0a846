"""A scripted engine core (token ids only, run in the core process) and letter tokenizers (API side).

Importable on its own, so the spawned core process can build ``FakeCore`` without the test fixtures.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from heron.config import EngineConfig
from heron.engine.messages import CoreInfo, EngineCoreOutput, EngineCoreRequest
from heron.engine.outputs import EngineStats
from heron.errors import EngineOverloadedError, InvalidRequestError, PromptTooLongError
from heron.sampling.sampler import TokenLogprobs

MAX_MODEL_LEN = 64
VOCAB = 26
BOOM = [1, 14, 14, 12]  # "boom": a request whose prompt holds it makes its third step raise
BOOM_AFTER = 2


class FakeTokenizer:
    """One character per token: token t is the letter chr(97 + t % 26); a chat is its contents joined."""

    chat_template = "contents joined"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [(ord(c) - 97) % 26 for c in text]

    def decode(self, ids: list[int], **kw) -> str:
        return "".join(chr(97 + t % 26) for t in ids)

    def get_vocab(self) -> dict[str, int]:
        return {chr(97 + t): t for t in range(VOCAB)}

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = True) -> str:
        return "".join(m["content"] for m in messages)


class RecordingTokenizer(FakeTokenizer):
    """A FakeTokenizer that records the thread of every call and whether two calls ever overlapped."""

    def __init__(self) -> None:
        self.threads: set[str] = set()
        self.calls = 0
        self.overlaps = 0
        self._active = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def _call(self) -> Iterator[None]:
        with self._lock:
            self.threads.add(threading.current_thread().name)
            self.calls += 1
            self._active += 1
            self.overlaps += self._active > 1
        time.sleep(0.001)  # widen the window in which a second thread would overlap
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._call():
            return super().encode(text, add_special_tokens)

    def decode(self, ids: list[int], **kw) -> str:
        with self._call():
            return super().decode(ids, **kw)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = True) -> str:
        with self._call():
            return super().apply_chat_template(messages, tokenize, add_generation_prompt)


@dataclass
class _Request:
    request: EngineCoreRequest
    outputs: list[list[int]]
    finish: list[str | None]
    steps: int = 0

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt_token_ids


def _holds(ids: list[int], part: list[int]) -> bool:
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def _logprobs(token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """Each token at rank 1 with logprob -0.5; then the following letters, each one less likely."""
    return [TokenLogprobs(t, -0.5, 1, [((t + k) % VOCAB, -0.5 - k) for k in range(num_top)]) for t in token_ids]


class FakeCore:
    """EngineCore's interface, scripted: each step appends to sample i of every request the letter i + 1 + k
    after the prompt's last (k: tokens so far), until max_tokens or the context is full.

    ``step_delay`` slows steps down; ``load_gate`` (a path) holds loading until that file exists.
    """

    def __init__(self, config: EngineConfig, step_delay: float = 0.0, load_gate: str | None = None) -> None:
        deadline = time.time() + 30
        while load_gate is not None and not Path(load_gate).exists() and time.time() < deadline:
            time.sleep(0.01)
        self.config = config
        self.step_delay = step_delay
        self.info = CoreInfo("fake", MAX_MODEL_LEN, VOCAB, [], 1000, 16)
        self.requests: dict[str, _Request] = {}
        self.counters = EngineStats()

    def add_request(self, request: EngineCoreRequest) -> bool:
        ids, n = request.prompt_token_ids, request.sampling_params.n
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if len(ids) >= MAX_MODEL_LEN:
            raise PromptTooLongError(f"prompt has {len(ids)} tokens, limit {MAX_MODEL_LEN}", param="prompt")
        if sum(not r.steps for r in self.requests.values()) >= self.config.max_waiting_requests:
            raise EngineOverloadedError("too many requests are waiting; retry later")
        self.requests[request.request_id] = _Request(request, [[] for _ in range(n)], [None] * n)
        return True

    def admit_compiled(self) -> tuple[list[str], list]:
        return [], []  # no grammars here: every add is admitted at once

    def wait_handles(self) -> list:
        return []

    def check_health(self) -> None:
        pass  # one process: nothing else can die

    def shutdown(self) -> None:
        pass

    def abort_requests(self, request_ids) -> None:
        for request_id in request_ids:
            if self.requests.pop(request_id, None) is not None:
                self._count("abort")

    def stop_samples(self, samples) -> None:
        for request_id, index in samples:
            req = self.requests.get(request_id)
            if req is not None:
                req.finish[index] = "stop"
                if all(req.finish):
                    del self.requests[request_id]
                    self._count("stop")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work_to_step(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[EngineCoreOutput]:
        time.sleep(self.step_delay)
        if any(_holds(r.prompt, BOOM) and r.steps >= BOOM_AFTER for r in self.requests.values()):
            raise RuntimeError("scripted failure")
        c = self.counters
        c.max_running_seen = max(c.max_running_seen, len(self.requests))
        outputs = []
        for req in list(self.requests.values()):
            p = req.request.sampling_params
            if not req.steps:
                c.prompt_tokens += len(req.prompt)
            prompt_lps = _logprobs(req.prompt[1:], p.prompt_logprobs) if p.prompt_logprobs is not None \
                and not req.steps else None
            req.steps += 1
            for i, out in enumerate(req.outputs):
                if req.finish[i] is not None:
                    continue
                token = (req.prompt[-1] + len(out) + 1 + i) % VOCAB
                out.append(token)
                c.generation_tokens += 1
                if len(out) >= (p.max_tokens or MAX_MODEL_LEN - len(req.prompt)):
                    req.finish[i] = "length"
                lps = _logprobs([token], p.logprobs) if p.logprobs is not None else None
                outputs.append(EngineCoreOutput(req.request.request_id, i, [token], lps,
                                                prompt_lps if i == 0 else None, req.finish[i]))
            if all(req.finish):
                del self.requests[req.request.request_id]
                self._count(req.finish[0])
        return outputs

    def _count(self, reason: str) -> None:
        self.counters.finished_by_reason[reason] = self.counters.finished_by_reason.get(reason, 0) + 1

    def stats(self) -> EngineStats:
        used = sum(len(r.prompt) + len(r.outputs[0]) for r in self.requests.values())
        return EngineStats(**{**vars(self.counters), "num_running": len(self.requests),
                              "kv_cache_usage": min(1.0, used / 1000),
                              "finished_by_reason": dict(self.counters.finished_by_reason)})
