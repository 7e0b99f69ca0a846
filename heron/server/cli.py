"""``heron serve [MODEL]`` and ``python -m heron.entrypoints.openai.api_server``: vLLM's flags, same meanings."""

from __future__ import annotations

import argparse
import os
import sys

from heron.config import DEFAULT_MODEL, EngineConfig, parse_size
from heron.errors import ConfigError, HeronError
from heron.server.reasoning import REASONING_PARSERS
from heron.server.tool_parsers import TOOL_PARSERS
from heron.server.tools import ToolSettings

_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (from EngineConfig) plus the HTTP server's."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="model to serve (same as --model)")
    EngineConfig.add_cli_args(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="0.0.0.0", help="address to listen on (default: 0.0.0.0)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    server.add_argument("--api-key", default=os.environ.get("HERON_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $HERON_API_KEY)")
    server.add_argument("--uvicorn-log-level", default="info", choices=_LOG_LEVELS, help="uvicorn's log level")
    server.add_argument("--disable-log-requests", action="store_true", help="do not log one line per request")
    server.add_argument("--shutdown-timeout", type=float, default=5.0,
                        help="on SIGTERM, seconds in-flight requests may run on (new ones get 503) before the rest "
                             "end with an error (default: 5)")
    server.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="accepted for vLLM compatibility: heron always reports "
                             "usage.prompt_tokens_details.cached_tokens")
    server.add_argument("--max-request-body", default="32MiB",
                        help="largest request body accepted, e.g. 32MiB; larger ones get 413 (default: 32MiB)")
    chat = parser.add_argument_group("tool calling and reasoning (docs/tool_calling.md)")
    chat.add_argument("--enable-auto-tool-choice", action="store_true",
                      help='let the model decide to call tools (tool_choice "auto"); a model whose chat template '
                           "renders tools also needs --tool-call-parser")
    chat.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                      help="the format in which the model writes tool calls, read for tool_choice \"auto\"")
    chat.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                      help="return the model's <think>...</think> text as reasoning_content")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed serve arguments; the positional MODEL wins over --model."""
    if args.model_tag is not None:
        if args.model not in (args.model_tag, DEFAULT_MODEL):
            raise ConfigError(f"MODEL {args.model_tag!r} and --model {args.model!r} disagree; give one")
        args.model = args.model_tag
    return EngineConfig.from_cli_args(args)


def serve(args: argparse.Namespace) -> int:
    """Run the server with parsed arguments; returns the exit code."""
    from heron.server.api_server import ServerOptions, run_server

    config = config_from_args(args)
    options = ServerOptions(host=args.host, port=args.port, api_key=args.api_key,
                            log_requests=not args.disable_log_requests, uvicorn_log_level=args.uvicorn_log_level,
                            shutdown_timeout=args.shutdown_timeout,
                            max_request_body=parse_size(args.max_request_body),
                            tools=ToolSettings(args.enable_auto_tool_choice, args.tool_call_parser),
                            reasoning_parser=args.reasoning_parser)
    run_server(config, options)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``heron serve``."""
    parser = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                                   description="Serve a model over an OpenAI-compatible HTTP API.")
    add_server_args(parser)
    parser.set_defaults(func=serve)
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Parse ``argv`` and serve; user errors print one ``error:`` line and exit 1."""
    parser = argparse.ArgumentParser(prog=prog, description="Serve a model over an OpenAI-compatible HTTP API.")
    add_server_args(parser)
    args = parser.parse_args(argv)
    try:
        sys.exit(serve(args))
    except HeronError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
