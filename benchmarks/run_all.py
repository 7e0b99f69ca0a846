"""Start heron, the HF baseline and llama.cpp one after another, run the same sweep against each, and write
results, plots and a markdown report.

    python -m benchmarks.run_all [--engines heron,hf,llamacpp] [--concurrency 1,4,16] [--num-prompts 32]
                                 [--input-len 128] [--output-len 64] [--out-dir benchmarks/results/serve]

Each server runs alone on the machine while it is measured; its log goes to ~/.cache/heron/bench-logs/.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from heron.bench.cli import add_baseline_parser, add_parser
from heron.bench.cost import cost_rows, cost_table
from heron.bench.report import markdown_table, plot_results
from heron.bench.result import load_result, machine_info
from heron.model.default_model import heron_cache_dir

PORTS = {"heron": 8000, "hf": 8001, "llamacpp": 8002}


def server_command(engine: str, model: str, port: int, parallel: int, extra: list[str]) -> list[str]:
    """The command that starts ``engine`` serving ``model`` on 127.0.0.1:``port``."""
    heron = [sys.executable, "-m", "heron"]
    if engine == "heron":
        return heron + ["serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
                        "--disable-log-requests", "--uvicorn-log-level", "warning", *extra]
    if engine == "hf":
        return heron + ["baseline", "hf", "--model", model, "--port", str(port)]
    if engine == "llamacpp":
        return heron + ["baseline", "llamacpp", "--model", model, "--port", str(port), "--parallel", str(parallel)]
    raise SystemExit(f"unknown engine {engine!r}; choose from {', '.join(PORTS)}")


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Poll ``url``/health until it answers 200 (the model is loaded); fail if the server exits or the timeout
    passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"{url} was not ready after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """Stop a server we started: SIGTERM, then SIGKILL after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def bench(engine: str, url: str, args: argparse.Namespace, out: Path) -> None:
    """Run ``heron bench serve`` against ``url`` with the shared sweep."""
    parser = argparse.ArgumentParser(prog="heron")
    sub = parser.add_subparsers()
    add_parser(sub)
    add_baseline_parser(sub)
    argv = ["bench", "serve", "--base-url", url, "--model", args.model, "--label", engine,
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--warmup", str(args.warmup),
            "--sweep-concurrency", args.concurrency, "--save-result", str(out), "--seed", str(args.seed)]
    if args.goodput:
        argv += ["--goodput", *args.goodput.split()]
    ns = parser.parse_args(argv)
    ns.func(ns)


def run_engine(engine: str, args: argparse.Namespace, out_dir: Path) -> None:
    """Start one engine, benchmark it into OUT_DIR/serve_ENGINE.json, stop it."""
    (out_dir / f"serve_{engine}.json").unlink(missing_ok=True)
    port = PORTS[engine]
    url = f"http://127.0.0.1:{port}"
    parallel = max(int(c) for c in args.concurrency.split(","))
    cmd = server_command(engine, args.model, port, parallel, args.heron_args.split())
    logs = heron_cache_dir() / "bench-logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"== {engine}: {' '.join(cmd)}", flush=True)
    with open(logs / f"{engine}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(url, proc, args.ready_timeout)
            bench(engine, url, args, out_dir / f"serve_{engine}.json")
        finally:
            stop(proc)


def _load(values: list[float] | None) -> str:
    return "/".join(str(x) for x in values) if values else "unknown"


def _settings(doc: dict) -> str:
    """One line of what a result measured, read from its own configuration."""
    d, f = doc["config"]["dataset"], doc["config"]["flags"]
    sweep = f.get("sweep_concurrency") or [f.get("max_concurrency")]
    return (f"{d['name']} prompts of {d['input_len']} tokens, {d['output_len']} output tokens"
            f"{' (ignore_eos)' if f.get('ignore_eos') else ''}, {d['num_prompts']} requests per point after "
            f"{f.get('warmup', 0)} warmup, concurrency {','.join(str(c) for c in sweep)}, rate {f['request_rate']}")


def write_report(results: list[Path], args: argparse.Namespace, out_dir: Path) -> Path:
    """report.md: for each engine its date, machine load and settings; the comparison table, cost, plots."""
    docs = [load_result(p) for p in results]
    plots = plot_results(docs, out_dir)
    m = machine_info()
    lines = ["# heron serving benchmark", "",
             f"Machine: {m['cpu']}, {m['cpu_count']} cores, {m['memory_gib']} GiB"
             + (f", GPUs: {', '.join(m['gpus'])}" if m["gpus"] else "") + f"; model: {docs[0]['config']['model'] if docs else args.model}.", ""]
    for doc in docs:
        start, end = (_load(doc["machine"].get(k)) for k in ("load_average", "load_average_end"))
        lines.append(f"- {doc['config']['label']}: measured {doc['date']} (load average 1/5/15 min at start "
                     f"{start}, at end {end}); {_settings(doc)}")
    lines += ["", markdown_table(docs)]
    if args.price_per_hour:
        rows = [row for d in docs for row in cost_rows(d, args.price_per_hour, args.api_price_in, args.api_price_out)]
        lines += ["## Cost", "", cost_table(rows, args.price_per_hour)]
    lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    report = out_dir / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="heron,hf,llamacpp", help="engines to run, in order")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model every engine serves")
    ap.add_argument("--concurrency", default="1,4,16", help="sweep of max concurrency")
    ap.add_argument("--num-prompts", type=int, default=16, help="requests per concurrency")
    ap.add_argument("--warmup", type=int, default=2, help="unrecorded warmup requests per engine")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--goodput", default="ttft:2000 tpot:200", help="SLOs, space-separated KEY:MS")
    ap.add_argument("--heron-args", default="", help="extra flags for `heron serve`")
    ap.add_argument("--ready-timeout", type=float, default=1800, help="seconds to wait for a server to load "
                    "(llama.cpp's first start includes its build)")
    ap.add_argument("--price-per-hour", type=float, default=None, help="machine $/h for the cost table")
    ap.add_argument("--api-price-in", type=float, default=None)
    ap.add_argument("--api-price-out", type=float, default=None)
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results" / "serve"))
    ap.add_argument("--report-only", action="store_true", help="rebuild the report from existing results")
    args = ap.parse_args()
    out_dir = Path(args.out_dir)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for engine in [] if args.report_only else engines:
        try:
            run_engine(engine, args, out_dir)
        except (Exception, SystemExit) as e:  # one engine failing must not lose the others' figures
            print(f"== {engine} failed: {e}; see {heron_cache_dir() / 'bench-logs' / (engine + '.log')}", flush=True)
    # the report covers every engine measured into OUT_DIR, so re-running one engine keeps the others
    known = [out_dir / f"serve_{e}.json" for e in PORTS]
    results = [p for p in known if p.is_file()] + sorted(set(out_dir.glob("serve_*.json")) - set(known))
    report = write_report(results, args, out_dir)
    print(report.read_text())
    print(json.dumps({"report": str(report)}))


if __name__ == "__main__":
    main()
