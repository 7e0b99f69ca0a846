"""The unoptimized baseline: FastAPI + transformers ``generate``, one request at a time, OpenAI routes.

This is the endpoint people write first: correct and honest (same weights, streaming, usage counts, stop
strings, cancellation on disconnect) but with no batching, no paged KV cache and no scheduling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from heron.bench.baselines.hf_requests import GenRequest, parse_chat, parse_completion
from heron.errors import InvalidRequestError

OWNED_BY = "hf-baseline"


@dataclass
class Finish:
    """The end of a generation: why it stopped and how many tokens it made."""

    reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclass
class HFBackend:
    """A transformers model and tokenizer behind an asyncio lock: generations run strictly one at a time."""

    model: object
    tokenizer: object
    name: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def max_len(self) -> int:
        """The model's context length."""
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    def _generate(self, req: GenRequest, streamer, cancel: threading.Event) -> int:
        """Blocking ``model.generate`` in a worker thread; returns the number of new tokens."""
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        class Cancelled(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), cancel.is_set(), dtype=torch.bool, device=input_ids.device)

        if req.seed is not None:
            torch.manual_seed(req.seed)
        ids = torch.tensor([req.prompt_ids], device=self.model.device)
        sample = req.temperature > 1e-5
        kwargs = {"do_sample": sample, "temperature": req.temperature if sample else None,
                  "top_p": req.top_p if sample else None, "top_k": req.top_k if sample and req.top_k > 0 else None}
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=req.max_tokens,
                min_new_tokens=req.max_tokens if req.ignore_eos else None, streamer=streamer,
                stopping_criteria=StoppingCriteriaList([Cancelled()]),
                pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id, **kwargs)
        return int(out.shape[1] - ids.shape[1])

    async def stream(self, req: GenRequest) -> AsyncIterator[str | Finish]:
        """Yield text pieces as they are generated, then one Finish. The lock is held until the thread ends."""
        from transformers import AsyncTextIteratorStreamer

        await self.lock.acquire()
        cancel = threading.Event()
        try:
            streamer = AsyncTextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
            future = asyncio.get_running_loop().run_in_executor(None, self._generate, req, streamer, cancel)
        except BaseException:
            self.lock.release()
            raise
        future.add_done_callback(lambda _: self.lock.release())
        text, sent, stopped = "", 0, False
        hold = max((len(s) for s in req.stop), default=1) - 1
        try:
            async for piece in streamer:
                text += piece
                cut = min((i for s in req.stop if (i := text.find(s)) >= 0), default=-1)
                if cut >= 0:
                    stopped = True
                    cancel.set()
                    if cut > sent:
                        yield text[sent:cut]
                    break
                if len(text) - hold > sent:
                    yield text[sent:len(text) - hold]
                    sent = len(text) - hold
            if not stopped and len(text) > sent:
                yield text[sent:]
            generated = await future
            reason = "length" if generated >= req.max_tokens and not stopped else "stop"
            yield Finish(reason, len(req.prompt_ids), generated)
        finally:
            cancel.set()


def _usage(f: Finish) -> dict:
    return {"prompt_tokens": f.prompt_tokens, "completion_tokens": f.completion_tokens,
            "total_tokens": f.prompt_tokens + f.completion_tokens}


def create_app(backend: HFBackend):
    """The FastAPI app: /health, /v1/models, /v1/completions, /v1/chat/completions (streaming or not)."""
    app = FastAPI(title="heron HF baseline")

    @app.exception_handler(InvalidRequestError)
    async def bad_request(_: Request, e: InvalidRequestError):
        return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error", "param": e.param,
                                       "code": 400}}, status_code=400)

    @app.get("/health")
    async def health():
        return {}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": backend.name, "object": "model", "created": 0,
                                            "owned_by": OWNED_BY, "max_model_len": backend.max_len}]}

    async def serve(request: Request, chat: bool):
        try:
            body = await request.json()
        except ValueError as e:
            raise InvalidRequestError(f"the request body is not valid JSON: {e}") from None
        parse = parse_chat if chat else parse_completion
        req = parse(body, backend.tokenizer, backend.max_len)
        meta = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
                "model": backend.name, "object": "chat.completion" if chat else "text_completion"}
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_events(backend.stream(req), meta, chat, usage), media_type="text/event-stream")
        text, finish = [], None
        async for item in backend.stream(req):
            if isinstance(item, Finish):
                finish = item
            else:
                text.append(item)
        out = "".join(text)
        choice = {"index": 0, "finish_reason": finish.reason, "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": out}} if chat else {"text": out})
        return {**meta, "choices": [choice], "usage": _usage(finish)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    return app


async def _events(items: AsyncIterator[str | Finish], meta: dict, chat: bool, usage: bool) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with an optional usage chunk and [DONE]."""
    meta = {**meta, "object": "chat.completion.chunk" if chat else "text_completion"}

    def chunk(text: str | None, reason: str | None) -> str:
        choice = {"index": 0, "finish_reason": reason, "logprobs": None}
        choice.update({"delta": {"content": text} if text is not None else {}} if chat else {"text": text or ""})
        return f"data: {json.dumps({**meta, 'choices': [choice]})}\n\n"

    if chat:
        yield f"data: {json.dumps({**meta, 'choices': [{'index': 0, 'delta': {'role': 'assistant'}}]})}\n\n"
    async for item in items:
        if isinstance(item, Finish):
            yield chunk(None, item.reason)
            if usage:
                yield f"data: {json.dumps({**meta, 'choices': [], 'usage': _usage(item)})}\n\n"
        elif item:
            yield chunk(item, None)
    yield "data: [DONE]\n\n"


def load_backend(model: str, served_name: str | None, device: str = "auto", dtype: str = "float32") -> HFBackend:
    """Load the same weights heron serves (HF dir, .gguf, or built-in name) with transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from heron.bench.resolve import resolve_model_files

    files = resolve_model_files(model)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = getattr(torch, dtype) if dtype != "auto" else "auto"
    tokenizer = AutoTokenizer.from_pretrained(str(files.directory), **files.hf_kwargs())
    hf_model = AutoModelForCausalLM.from_pretrained(str(files.directory), dtype=torch_dtype, **files.hf_kwargs())
    return HFBackend(hf_model.to(device).eval(), tokenizer, served_name or model)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``heron baseline hf``."""
    from heron.config import DEFAULT_MODEL

    parser.add_argument("--model", default=DEFAULT_MODEL, help="local HF directory, .gguf file or built-in "
                        f"model name (default: {DEFAULT_MODEL})")
    parser.add_argument("--served-model-name", default=None, help="model name the API reports (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8001, help="port to listen on (default: 8001)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="device (default: auto)")
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weight dtype (default: float32)")


def main(args: argparse.Namespace) -> int:
    """Load the model and serve it until interrupted."""
    import uvicorn

    backend = load_backend(args.model, args.served_model_name, args.device, args.dtype)
    print(f"HF baseline serving {backend.name} on http://{args.host}:{args.port} (one request at a time)")
    uvicorn.run(create_app(backend), host=args.host, port=args.port, log_level="warning")
    return 0
