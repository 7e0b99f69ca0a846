"""Errors as OpenAI shapes them: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status.

An unexpected exception is logged once: one line naming the request, and its traceback. Starlette's own
handler for ``Exception`` would log it and re-raise it for uvicorn to log again, so ``InternalErrorMiddleware``
answers it instead.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from heron.errors import (
    EngineDeadError,
    EngineOverloadedError,
    HeronError,
    InvalidRequestError,
    PromptTooLongError,
)
from heron.server.streaming import ClientDisconnected

logger = logging.getLogger("heron.server")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error with an HTTP status, raised by route code (unknown model, bad key, ...)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None
               ) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code if code is not None else status}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def as_api_error(exc: BaseException, request_id: str | None = None) -> APIError:
    """Map any exception to the API error a client should see; unknown ones are logged (naming
    ``request_id``) and hidden."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), exc.param, "context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), exc.param)
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc), code="overloaded")
    if isinstance(exc, EngineDeadError):
        return APIError(500, str(exc), code="engine_dead")
    if isinstance(exc, HeronError):
        return APIError(400, str(exc))
    logger.error("request %s failed with an internal error", request_id, exc_info=exc)
    return APIError(500, "internal server error; see the server log", code="internal_error")


def stream_error(exc: Exception, request_id: str) -> dict[str, Any]:
    """The in-band error event of a stream whose HTTP status was already sent."""
    err = as_api_error(exc, request_id)
    return error_body(err.status, err.message, err.param, err.code)


def describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    """A readable one-line message (and the offending field) for a pydantic validation failure."""
    errors = exc.errors()
    for err in errors:
        if err.get("type") == "json_invalid":
            return f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    # a validator's ValueError (text that is not Unicode) says more than the union members that did not match
    value_errors = [err for err in errors if err.get("type") == "value_error"]
    if value_errors:
        errors = value_errors
    locs = [[str(x) for x in err.get("loc", ()) if x != "body"] for err in errors]
    common = os.path.commonprefix(locs)
    if len(errors) > 1 and common and not value_errors:  # one field failing every member of a union type
        field = ".".join(common)
        kinds = sorted({loc[len(common)].replace("constrained-", "") for loc in locs if len(loc) > len(common)})
        return f"invalid request: {field}: expected {' or '.join(kinds)} (got {_shown(errors[0])})", field
    locs = [[x for x in loc if "[" not in x] for loc in locs]  # drop union members' names ("list[ContentPart]")
    parts = []
    for err, loc in zip(errors[:3], locs, strict=False):
        field = ".".join(loc) or "body"
        if err.get("type") == "missing":
            parts.append(f"missing required field '{field}'")
        else:
            # a validator's message alone, not pydantic's "Value error, <message>"
            msg = err["ctx"]["error"] if err.get("type") == "value_error" else err.get("msg")
            parts.append(f"{field}: {msg} (got {_shown(err)})")
    return "invalid request: " + "; ".join(parts), ".".join(locs[0]) or None


def _shown(err: dict) -> str:
    got = err.get("input")
    return (type(got).__name__ if isinstance(got, dict | list) else repr(got))[:80]


async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = describe_validation(exc)
    return error_response(400, message, param)


async def _on_http(request: Request, exc: HTTPException) -> Response:
    return error_response(exc.status_code, str(exc.detail))


async def _on_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, ClientDisconnected):
        return Response(status_code=499)
    err = as_api_error(exc)
    return error_response(err.status, err.message, err.param, err.code)


def request_label(scope: Scope) -> str:
    """The engine request id a route recorded in ``request.state.request_id``, else the method and path."""
    return scope.get("state", {}).get("request_id") or f"{scope['method']} {scope['path']}"


class InternalErrorMiddleware:
    """Answers any exception the routes and handlers let through with a 500 in OpenAI's shape, logged once."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_and_track(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_and_track)
        except Exception as exc:  # noqa: BLE001 - logged by as_api_error, answered here
            err = as_api_error(exc, request_label(scope))
            if not started:
                await error_response(err.status, err.message, err.param, err.code)(scope, receive, send)


def install_handlers(app) -> None:
    """Answer the errors the routes raise in OpenAI's JSON shape (``InternalErrorMiddleware`` answers the rest)."""
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(HTTPException, _on_http)
    app.add_exception_handler(HeronError, _on_error)
    app.add_exception_handler(APIError, _on_error)
    app.add_exception_handler(ClientDisconnected, _on_error)
