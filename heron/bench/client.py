"""One streaming request to an OpenAI-compatible endpoint, timed: TTFT, inter-token latencies, end-to-end."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class RequestConfig:
    """What every request of a run shares: where to send it and how to sample."""

    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    timeout_s: float = 600.0

    @property
    def url(self) -> str:
        """The full request URL."""
        return self.base_url.rstrip("/") + self.endpoint

    def headers(self) -> dict[str, str]:
        """HTTP headers, with the bearer token when an API key is set."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def payload(self, prompt: str, max_tokens: int) -> dict:
        """The JSON body: a streaming request asking for usage in the last chunk."""
        body: dict = {"model": self.model, "max_tokens": max_tokens, "temperature": self.temperature,
                      "stream": True, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.endpoint.endswith("/chat/completions"):
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body


@dataclass
class RequestRecord:
    """The outcome of one request. Times are seconds; ``start`` is relative to the run's start."""

    prompt_len: int
    expected_output_len: int
    success: bool = False
    error: str = ""
    error_detail: str = ""
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    output_tokens_source: str = ""
    generated_text: str = ""

    def fail(self, kind: str, detail: str) -> RequestRecord:
        """Mark this record failed with an error ``kind`` (http_500, disconnected, timeout, ...)."""
        self.success, self.error, self.error_detail = False, kind, detail[:300]
        return self


def _chunk_text(chunk: dict) -> str:
    """The text a streamed completion or chat chunk adds."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


async def _read_stream(response: aiohttp.ClientResponse, record: RequestRecord, t0: float) -> dict | None:
    """Consume the SSE stream into ``record``; return the usage object if the server sent one."""
    usage, last, text = None, t0, []
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise _StreamError(str(chunk["error"]))
        usage = chunk.get("usage") or usage
        piece = _chunk_text(chunk)
        if piece:
            now = time.perf_counter()
            if not text:
                record.ttft = now - t0
            else:
                record.itl.append(now - last)
            last = now
            text.append(piece)
    record.generated_text = "".join(text)
    return usage


class _StreamError(Exception):
    """An error object sent inside the event stream."""


async def send_request(session: aiohttp.ClientSession, cfg: RequestConfig, prompt: str, prompt_len: int,
                       max_tokens: int, run_start: float = 0.0, tokenizer=None) -> RequestRecord:
    """Send one streaming request and time it. Never raises for server or network failures: the record says."""
    record = RequestRecord(prompt_len, max_tokens)
    t0 = time.perf_counter()
    record.start = t0 - run_start
    try:
        timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
        async with session.post(cfg.url, json=cfg.payload(prompt, max_tokens), headers=cfg.headers(),
                                timeout=timeout) as response:
            if response.status != 200:
                return record.fail(f"http_{response.status}", await response.text())
            usage = await _read_stream(response, record, t0)
    except asyncio.TimeoutError:
        return record.fail("timeout", f"no complete response within {cfg.timeout_s} s")
    except aiohttp.ClientConnectorError as e:
        return record.fail("connection_error", repr(e))
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
        return record.fail("disconnected", repr(e))
    except (_StreamError, json.JSONDecodeError, UnicodeDecodeError) as e:
        return record.fail("bad_stream", repr(e))
    record.latency = time.perf_counter() - t0
    if not record.generated_text:
        return record.fail("empty_output", "the stream ended without any generated text")
    _count_output(record, usage, tokenizer)
    record.success = True
    return record


def _count_output(record: RequestRecord, usage: dict | None, tokenizer) -> None:
    """Output tokens from the server's usage when given, else from the tokenizer, else from chunk count."""
    if usage and usage.get("completion_tokens"):
        record.output_tokens, record.output_tokens_source = int(usage["completion_tokens"]), "usage"
    elif tokenizer is not None:
        ids = tokenizer.encode(record.generated_text, add_special_tokens=False)
        record.output_tokens, record.output_tokens_source = len(ids), "tokenizer"
    else:
        record.output_tokens, record.output_tokens_source = len(record.itl) + 1, "chunks"
