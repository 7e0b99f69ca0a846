"""The ``heron`` command: generate, serve, bench, baseline."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid

from heron import __version__
from heron.config import EngineConfig
from heron.errors import HeronError


def _add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate a completion for one prompt, streaming it to stdout",
                              description="Generate text from a prompt with the heron engine, printing tokens "
                                          "as they come.")
    p.add_argument("--prompt", "-p", required=True, help="the prompt (or the user message with --chat)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    p.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest tokens (default: off)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    """Stream one completion to stdout."""
    from heron.engine.engine import Engine
    from heron.sampling_params import RequestOutputKind, SamplingParams

    engine = Engine(EngineConfig.from_cli_args(args))
    prompt: str | list[int] = args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        prompt = engine.encode(engine.apply_chat_template(messages), add_special_tokens=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, output_kind=RequestOutputKind.DELTA)
    engine.add_request(uuid.uuid4().hex, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.outputs[0].text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from heron.bench.cli import add_baseline_parser
    from heron.bench.cli import add_parser as add_bench_parser
    from heron.server.cli import add_parser as add_serve_parser

    parser = argparse.ArgumentParser(prog="heron", description="heron: LLM inference and serving engine "
                                     "(paged KV cache, continuous batching, OpenAI-compatible server).")
    parser.add_argument("--version", action="version", version=f"heron {__version__}")
    parser.add_argument("--log-level", default=os.environ.get("HERON_LOG_LEVEL", "INFO"),
                        help="logging level (default: INFO, or $HERON_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_parser(sub)
    _add_generate_parser(sub)
    add_bench_parser(sub)
    add_baseline_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``heron`` console script. User errors print one line and exit 1 (HERON_DEBUG=1
    shows the traceback)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    try:
        code = args.func(args)
    except HeronError as e:
        if os.environ.get("HERON_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    sys.exit(code or 0)
