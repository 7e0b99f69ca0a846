"""The OpenAI-compatible HTTP server: app factory, routes, API-key check, and the uvicorn runner."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import heron
from heron.config import EngineConfig
from heron.engine.async_engine import AsyncEngine
from heron.errors import HeronError, InvalidRequestError, ModelLoadError
from heron.model.generation_config import default_sampling_params
from heron.server.chat import Chat
from heron.server.completions import Completions
from heron.server.embeddings import Embeddings
from heron.server.http_errors import APIError, InternalErrorMiddleware, error_body, install_handlers
from heron.server.metrics import CONTENT_TYPE, ServerMetrics
from heron.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from heron.server.reasoning import REASONING_PARSERS
from heron.server.serving import Serving
from heron.server.shutdown import FLUSH_TIMEOUT, Drain, DrainingServer
from heron.server.tools import ToolSettings

logger = logging.getLogger("heron.server")

_PROTECTED = ("/v1", "/pooling", "/tokenize", "/detokenize")


@dataclass
class ServerOptions:
    """Options of the HTTP layer (the engine's are in EngineConfig)."""

    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None
    log_requests: bool = True
    uvicorn_log_level: str = "info"
    shutdown_timeout: float = 5.0
    max_request_body: int = 32 * 1024**2
    tools: ToolSettings = field(default_factory=ToolSettings)  # --enable-auto-tool-choice, --tool-call-parser
    reasoning_parser: str | None = None  # a REASONING_PARSERS name


class APIKeyMiddleware:
    """Answers 401 to requests under /v1 (and /pooling, /tokenize, /detokenize) without ``Authorization: Bearer
    KEY``."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_PROTECTED) and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                body = error_body(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Answers 413 to a request whose body is over ``limit`` bytes: before reading it when its Content-Length
    says so, else as soon as the part read passes the limit."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit
        self.message = f"the request body is larger than the server's limit of {limit} bytes (--max-request-body)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            await JSONResponse(error_body(413, self.message), status_code=413)(scope, receive, send)
            return
        received = 0

        async def receive_within_limit() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise HTTPException(413, self.message)
            return message

        await self.app(scope, receive_within_limit, send)


def build_app(engine: AsyncEngine, options: ServerOptions, on_load_failure: Callable[[], None] | None = None
              ) -> FastAPI:
    """The FastAPI app serving ``engine``; starting the app starts the engine (which loads the model). Raises
    ConfigError for a ``--generation-config`` that cannot be used."""
    config = engine.config
    model_name = config.served_model_name or config.model
    metrics = ServerMetrics(model_name, engine.stats)
    serving = Serving(engine, metrics, model_name, options.log_requests,
                      default_sampling_params(config.model, config.generation_config))
    completions, chat, embeddings = Completions(serving), Chat(serving, options.tools, REASONING_PARSERS.get(options.reasoning_parser)), Embeddings(serving)
    drain = Drain(engine, options.shutdown_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        watcher = asyncio.create_task(_watch_load(engine, on_load_failure))
        yield
        watcher.cancel()
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="heron", version=heron.__version__, lifespan=lifespan)
    app.state.drain = drain
    install_handlers(app)
    app.add_middleware(BodyLimitMiddleware, limit=options.max_request_body)
    if options.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=options.api_key)
    app.add_middleware(InternalErrorMiddleware)  # added last: the outermost

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{model_name}`.",
                           param="model", code="model_not_found")

    @app.get("/health")
    async def health() -> Response:
        if drain.draining:
            return JSONResponse(error_body(503, "the server is shutting down"), status_code=503)
        if engine.ready:
            return Response(status_code=200)
        if engine.loading:
            return JSONResponse(error_body(503, "the model is loading"), status_code=503)
        reason = engine.dead_error or engine.load_error
        return JSONResponse(error_body(503, f"the engine is not healthy: {reason}"), status_code=503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": heron.__version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        max_len = engine.info.max_model_len if engine.info else config.max_model_len
        card = ModelCard(id=model_name, root=config.model, max_model_len=max_len)
        return ModelList(data=[card]).model_dump()

    def check_runner(path: str, wanted: str) -> None:
        """Refuse a route the engine's runner does not serve, naming the flag that would."""
        if config.runner == wanted:
            return
        if wanted == "pooling":
            raise APIError(400, f"{path} needs a server started with --runner pooling (or --task embed); this one "
                                "generates text")
        raise APIError(400, f"this server was started with --runner pooling: it serves /v1/embeddings and "
                            f"/pooling, not {path}; start it without --runner pooling to generate text")

    def admit(path: str, runner: str, model: str | None) -> None:
        """What every generation or pooling route checks first: admitting, the runner, the model name."""
        drain.check_admitting()
        check_runner(path, runner)
        check_model(model)

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw: Request) -> Response:
        admit("/v1/completions", "generate", req.model)
        return await completions.create(req, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
        admit("/v1/chat/completions", "generate", req.model)
        return await chat.create(req, raw)

    @app.post("/v1/embeddings")
    async def create_embedding(req: EmbeddingRequest, raw: Request) -> Response:
        admit("/v1/embeddings", "pooling", req.model)
        return await embeddings.create(req, raw)

    @app.post("/pooling")
    async def create_pooling(req: EmbeddingRequest, raw: Request) -> Response:
        admit("/pooling", "pooling", req.model)
        return await embeddings.create(req, raw, pooling_api=True)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
        text = req.prompt if req.prompt is not None else await chat.render(req.messages)
        add_special = req.add_special_tokens and req.messages is None
        tokens = await engine.call(lambda e: e.encode(text, add_special_tokens=add_special))
        return {"count": len(tokens), "max_model_len": engine.info.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        check_model(req.model)
        vocab, max_len = (engine.info.vocab_size, engine.info.max_model_len) if engine.info else (0, 0)
        if len(req.tokens) > max_len:  # more cannot come from one request, and would hold the tokenizer
            raise InvalidRequestError(f"at most max_model_len ({max_len}) tokens can be detokenized at once",
                                      param="tokens")
        if any(not 0 <= t < vocab for t in req.tokens):
            raise InvalidRequestError(f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": await engine.call(lambda e: e.tokenizer.decode(req.tokens))}

    return app


async def _watch_load(engine: AsyncEngine, on_failure: Callable[[], None] | None) -> None:
    await engine.wait_loaded()
    if engine.load_error is not None and on_failure is not None:
        on_failure()
    elif engine.info is not None:
        logger.info("model %s loaded (max_model_len %d); serving", engine.info.model_name, engine.info.max_model_len)


def run_server(config: EngineConfig, options: ServerOptions) -> None:
    """Serve until SIGTERM/SIGINT, then drain (see ``shutdown.py``) and return normally; raises ModelLoadError
    if the model failed to load."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = AsyncEngine(config)
    server: uvicorn.Server | None = None

    def stop() -> None:
        server.should_exit = True

    app = build_app(engine, options, on_load_failure=stop)
    server = DrainingServer(uvicorn.Config(app, host=options.host, port=options.port,
                                           log_level=options.uvicorn_log_level,
                                           timeout_graceful_shutdown=FLUSH_TIMEOUT), app.state.drain)
    server.run()
    error = engine.load_error
    if isinstance(error, HeronError):
        raise error
    if error is not None:
        raise ModelLoadError(f"the model failed to load: {type(error).__name__}: {error}") from error

