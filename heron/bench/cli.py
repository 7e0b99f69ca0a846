"""``heron bench {serve,throughput,latency,compare,cost}`` and ``heron baseline {hf,llamacpp}``."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
from pathlib import Path
from urllib.parse import urlparse

from heron.bench.client import ENDPOINTS, RequestConfig
from heron.bench.datasets import DATASETS, DatasetSpec, sample_requests
from heron.errors import ConfigError


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None, plain switches, and those the help text already states."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,4,16, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("concurrency values must be integers >= 1")
    return values


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """Flags that choose and shape the prompts (shared by serve and throughput)."""
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset", choices=DATASETS, default="random",
                   help="random token prompts, ShareGPT-format JSON conversations, or prompts sharing a prefix")
    g.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file (for --dataset sharegpt)")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens (random; suffix tokens for prefix)")
    g.add_argument("--output-len", type=int, default=64, help="output tokens per request (random, prefix)")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly in [len*(1-r), len*(1+r)]")
    g.add_argument("--prefix-len", type=int, default=256, help="tokens of the shared prefix (prefix dataset)")
    g.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes (prefix dataset)")
    g.add_argument("--num-prompts", type=int, default=64, help="requests per run (per sweep point)")
    g.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival times")


def _spec(args: argparse.Namespace, num_prompts: int) -> DatasetSpec:
    return DatasetSpec(args.dataset, num_prompts, args.input_len, args.output_len, args.range_ratio,
                       args.dataset_path, args.prefix_len, args.num_prefixes, args.seed)


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", formatter_class=_Formatter, help="load-test an OpenAI-compatible endpoint",
                       description="Load-test any OpenAI-compatible server over HTTP (streaming): TTFT, TPOT, "
                       "ITL, end-to-end latency, throughput, goodput and errors.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL, without /v1")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first model)")
    p.add_argument("--endpoint", choices=ENDPOINTS, default="/v1/completions", help="API route to load")
    p.add_argument("--api-key", default=None, help="bearer token, if the server needs one")
    p.add_argument("--label", default=None, help="engine name in reports (default: the server's owned_by)")
    p.add_argument("--tokenizer", default=None, help="tokenizer: local HF dir, .gguf or built-in model name "
                   "(default: --model)")
    add_dataset_args(p)
    g = p.add_argument_group("load shape")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: unbounded)")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second; inf sends all at once, else gamma/Poisson arrivals")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival times: 1 = Poisson, < 1 burstier, > 1 steadier")
    g.add_argument("--warmup", type=int, default=0, help="unrecorded requests sent before measuring")
    g.add_argument("--sweep-concurrency", type=_int_list, default=None,
                   help="run once per max concurrency, e.g. 1,4,16,32 (overrides --max-concurrency)")
    g = p.add_argument_group("measurement")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (keys: ttft, tpot, e2el; milliseconds)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature sent with each request")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask the server to always generate the full --output-len")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds before a request counts as timed out")
    g.add_argument("--save-result", default=None,
                   help="write the JSON result (config + every request) here; it also holds the top-level keys of "
                   "`vllm bench serve`'s results (of the last run, after a sweep)")
    g.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """``heron bench serve``."""
    from heron.bench.metrics import parse_goodput
    from heron.bench.report import format_run, markdown_table
    from heron.bench.resolve import load_tokenizer
    from heron.bench.result import machine_info, make_result, now_iso, save_result
    from heron.bench.serve import LoadShape, probe_server, run_sweep
    from heron.bench.vllm_format import vllm_fields

    slos = parse_goodput(args.goodput)
    cfg = RequestConfig(args.base_url, args.model or "", args.endpoint, args.api_key, args.temperature,
                        args.ignore_eos, args.timeout)
    served = asyncio.run(probe_server(cfg))
    cfg.model = args.model or served.get("id") or ""
    if not cfg.model:
        raise ConfigError("the server lists no model; pass --model")
    label = args.label or served.get("owned_by") or urlparse(args.base_url).netloc
    tokenizer = load_tokenizer(args.tokenizer or cfg.model)
    concurrencies = args.sweep_concurrency or [args.max_concurrency]
    shapes = [LoadShape(args.request_rate, args.burstiness, c, args.seed) for c in concurrencies]
    for shape in shapes:
        shape.validate()
    requests = sample_requests(_spec(args, args.warmup + args.num_prompts * len(shapes)), tokenizer)
    machine, date = machine_info(), now_iso()
    runs = asyncio.run(run_sweep(cfg, requests, shapes, args.warmup, tokenizer, not args.no_progress))
    stored = [run.to_json(slos) for run in runs]
    flags = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
    flags["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    config = {"label": label, "engine": served.get("owned_by"), "model": cfg.model, "base_url": args.base_url,
              "endpoint": args.endpoint, "dataset": dataclasses.asdict(_spec(args, args.num_prompts)),
              "flags": flags}
    machine["load_average_end"] = machine_info()["load_average"]
    result = make_result("serve", config, stored, machine, date)
    result.update(vllm_fields(result))
    for run in stored:
        print(format_run(run, f"{label}: serving benchmark"))
    if len(stored) > 1:
        print(markdown_table([result]))
    if args.save_result:
        print(f"saved {save_result(result, args.save_result)}")
    return 0 if any(r["summary"]["completed"] for r in stored) else 1


def _add_offline(sub) -> None:
    from heron.config import EngineConfig

    p = sub.add_parser("throughput", formatter_class=_Formatter, help="offline throughput, engine in-process",
                       description="Generate a whole dataset with heron's LLM in this process; report requests "
                       "and tokens per second.")
    add_dataset_args(p)
    p.add_argument("--save-result", default=None, help="write the JSON result here")
    EngineConfig.add_cli_args(p, skip=("seed",))
    p.set_defaults(func=run_throughput)
    p = sub.add_parser("latency", formatter_class=_Formatter, help="end-to-end latency of one batch",
                       description="Time one batch of random prompts end to end with heron's LLM in-process.")
    p.add_argument("--batch-size", type=int, default=8, help="prompts in the batch")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="output tokens")
    p.add_argument("--num-iters-warmup", type=int, default=1, help="untimed iterations first")
    p.add_argument("--num-iters", type=int, default=3, help="timed iterations")
    p.add_argument("--save-result", default=None, help="write the JSON result here")
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=run_latency)


def _llm(args: argparse.Namespace):
    from heron.config import EngineConfig
    from heron.llm import LLM

    config = EngineConfig.from_cli_args(args)
    return LLM(**dataclasses.asdict(config)), config


def run_throughput(args: argparse.Namespace) -> int:
    """``heron bench throughput``."""
    from heron.bench.offline import format_throughput, measure_throughput
    from heron.bench.result import make_result, save_result

    llm, config = _llm(args)
    requests = sample_requests(_spec(args, args.num_prompts), llm.get_tokenizer())
    m = measure_throughput(llm, requests)
    print(format_throughput(m))
    if args.save_result:
        cfg = {"label": "heron", "engine": "heron", "model": args.model, "engine_config": dataclasses.asdict(config),
               "dataset": dataclasses.asdict(_spec(args, args.num_prompts))}
        print(f"saved {save_result(make_result('throughput', cfg, [m]), args.save_result)}")
    return 0


def run_latency(args: argparse.Namespace) -> int:
    """``heron bench latency``."""
    from heron.bench.offline import format_latency, measure_latency
    from heron.bench.result import make_result, save_result

    llm, config = _llm(args)
    m = measure_latency(llm, args.batch_size, args.input_len, args.output_len, args.num_iters,
                        args.num_iters_warmup, args.seed)
    print(format_latency(m))
    if args.save_result:
        cfg = {"label": "heron", "engine": "heron", "model": args.model, "engine_config": dataclasses.asdict(config)}
        print(f"saved {save_result(make_result('latency', cfg, [m]), args.save_result)}")
    return 0


def _add_reports(sub) -> None:
    p = sub.add_parser("compare", formatter_class=_Formatter, help="markdown table + plots of several results",
                       description="Compare `heron bench serve --save-result` and `vllm bench serve "
                       "--save-result` files side by side: a markdown table and PNG plots (throughput vs "
                       "concurrency, TTFT and TPOT percentiles).")
    p.add_argument("results", nargs="+", metavar="RESULT.json",
                   help="result files (heron's or vLLM's), one or more per engine")
    p.add_argument("--out-dir", default=None, help="write comparison.md and the PNG plots here")
    p.set_defaults(func=run_compare)
    p = sub.add_parser("cost", formatter_class=_Formatter, help="$ per million tokens from a measured result",
                       description="Tokens per day and $ per million tokens at a machine's hourly price, and "
                       "the saving against an API's per-token prices.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--result", help="a `heron bench serve` (or `vllm bench serve`) result file")
    src.add_argument("--tokens-per-second", type=float, help="price a throughput given by hand instead")
    p.add_argument("--price-per-hour", type=float, required=True, help="machine price in $ per hour, e.g. 6.76")
    p.add_argument("--api-price-in", type=float, default=None, help="API $ per million input tokens, e.g. 5")
    p.add_argument("--api-price-out", type=float, default=None, help="API $ per million output tokens, e.g. 15")
    p.add_argument("--tokens-per-day", type=float, default=None,
                   help="also price a daily volume served by one such machine billed all day")
    p.set_defaults(func=run_cost)


def _serve_results(paths: list[str]) -> list[dict]:
    from heron.bench.result import load_result

    results = [load_result(p) for p in paths]
    for path, res in zip(paths, results, strict=True):
        if res.get("kind") != "serve":
            raise ConfigError(f"{path} is a {res.get('kind')!r} result; compare and cost take serve results")
    return results


def run_compare(args: argparse.Namespace) -> int:
    """``heron bench compare``."""
    from heron.bench.report import markdown_table, plot_results

    results = _serve_results(args.results)
    table = markdown_table(results)
    print(table)
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "comparison.md").write_text(table)
        for path in plot_results(results, out):
            print(f"wrote {path}")
    return 0


def run_cost(args: argparse.Namespace) -> int:
    """``heron bench cost``."""
    from heron.bench.cost import cost_per_million, cost_per_million_per_day, cost_rows, cost_table

    if args.result:
        print(cost_table(cost_rows(_serve_results([args.result])[0], args.price_per_hour, args.api_price_in,
                                   args.api_price_out), args.price_per_hour))
    else:
        tps = args.tokens_per_second
        print(f"{tps:g} tokens/s = {tps * 86400 / 1e6:.1f}M tokens/day; at ${args.price_per_hour:g}/h: "
              f"${cost_per_million(tps, args.price_per_hour):.3f} per million tokens")
    if args.tokens_per_day:
        print(f"{args.tokens_per_day / 1e6:g}M tokens/day on one machine at ${args.price_per_hour:g}/h: "
              f"${cost_per_million_per_day(args.tokens_per_day, args.price_per_hour):.3f} per million tokens")
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``heron bench`` and its subcommands."""
    p = subparsers.add_parser("bench", help="benchmark tools: serve, throughput, latency, compare, cost",
                              description="Benchmark heron or any OpenAI-compatible server.")
    sub = p.add_subparsers(dest="bench_command", metavar="{serve,throughput,latency,compare,cost}", required=True)
    _add_serve(sub)
    _add_offline(sub)
    _add_reports(sub)
    return p


def add_baseline_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``heron baseline`` (hf, llamacpp)."""
    from heron.bench.baselines import hf_server, llamacpp

    p = subparsers.add_parser("baseline", help="start a baseline server: hf (transformers) or llamacpp",
                              description="Start a baseline server that `heron bench serve` can measure.")
    sub = p.add_subparsers(dest="baseline_command", metavar="{hf,llamacpp}", required=True)
    hf = sub.add_parser("hf", formatter_class=_Formatter, help="naive FastAPI + transformers server",
                        description=hf_server.__doc__)
    hf_server.add_arguments(hf)
    hf.set_defaults(func=hf_server.main)
    lc = sub.add_parser("llamacpp", formatter_class=_Formatter, help="llama.cpp's llama-server (built on demand)",
                        description=llamacpp.__doc__)
    llamacpp.add_arguments(lc)
    lc.set_defaults(func=llamacpp.main)
    return p
