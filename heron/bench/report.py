"""Human-readable output of results: the end-of-run table, the markdown comparison, and PNG plots."""

from __future__ import annotations

import math
from pathlib import Path

from heron.bench.metrics import LATENCIES, STATS
from heron.bench.result import engine_label

_NAMES = {"ttft": "Time to first token", "tpot": "Time per output token (excl. 1st)",
          "itl": "Inter-token latency", "e2el": "End-to-end latency"}


def _concurrency(run: dict) -> str:
    return str(run.get("max_concurrency") or "unbounded")


def format_run(run: dict, title: str = "Serving benchmark result") -> str:
    """A vLLM-style block of one run's summary, for the terminal."""
    s = run["summary"]
    rows = [("Max concurrency", _concurrency(run)), ("Request rate (req/s)", str(run.get("request_rate"))),
            ("Successful requests", s["completed"]), ("Failed requests", s["failed"])]
    rows += [(f"  errors: {kind}", n) for kind, n in sorted(s["errors"].items())]
    rows += [("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
             ("Total input tokens", s["total_input_tokens"]), ("Total output tokens", s["total_output_tokens"]),
             ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
             ("Input token throughput (tok/s)", f"{s['input_throughput']:.2f}"),
             ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
             ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}")]
    if "request_goodput" in s:
        slos = " ".join(f"{k}:{v:g}" for k, v in s["goodput_slos_ms"].items())
        rows.append((f"Request goodput (req/s) [{slos}]", f"{s['request_goodput']:.2f}"))
    lines = [f"{f' {title} ':=^60}"] + [f"{k:<44}{v:>16}" for k, v in rows]
    for lat in LATENCIES:
        lines.append(f"{f' {_NAMES[lat]} ':-^60}")
        lines += [f"{f'{stat.capitalize()} {lat.upper()} (ms)':<44}{s[lat + '_ms'][stat]:>16.2f}" for stat in STATS]
    if "spec_decode_acceptance_rate" in s:
        lines.append(f"{' Speculative decoding ':-^60}")
        spec = [("Acceptance rate (%)", f"{100 * s['spec_decode_acceptance_rate']:.2f}"),
                ("Mean acceptance length", f"{s['spec_decode_mean_acceptance_length']:.2f}"),
                ("Drafts", s["spec_decode_num_drafts"])]
        spec += [(label, s[key]) for label, key in (("Draft tokens", "spec_decode_num_draft_tokens"),
                                                    ("Accepted tokens", "spec_decode_num_accepted_tokens"))
                 if key in s]
        lines += [f"{k:<44}{v:>16}" for k, v in spec]
    lines.append("=" * 60)
    return "\n".join(lines)


def _rows(results: list[dict]) -> list[tuple[str, dict]]:
    return [(engine_label(res), run) for res in results for run in res["runs"]]


def markdown_table(results: list[dict]) -> str:
    """One markdown row per (engine, run): throughput, TTFT/TPOT/ITL/E2E percentiles, errors."""
    head = ("| engine | concurrency | req/s | out tok/s | total tok/s | TTFT p50 | TTFT p99 | TPOT p50 | "
            "TPOT p99 | ITL p99 | E2E p50 | E2E p99 | ok | errors | goodput |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for label, run in _rows(results):
        s = run["summary"]
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(s["errors"].items())) or "0"
        cells = [label, _concurrency(run), f"{s['request_throughput']:.2f}", f"{s['output_throughput']:.1f}",
                 f"{s['total_token_throughput']:.1f}", _ms(s["ttft_ms"]["median"], 0), _ms(s["ttft_ms"]["p99"], 0),
                 _ms(s["tpot_ms"]["median"], 1), _ms(s["tpot_ms"]["p99"], 1), _ms(s["itl_ms"]["p99"], 1),
                 _ms(s["e2el_ms"]["median"], 0), _ms(s["e2el_ms"]["p99"], 0), str(s["completed"]), errors,
                 _goodput(s)]
        lines.append("| " + " | ".join(cells) + " |")
    slos = sorted({" ".join(f"{k}:{v:g}" for k, v in run["summary"]["goodput_slos_ms"].items())
                   for _, run in _rows(results) if "goodput_slos_ms" in run["summary"]})
    note = f"; goodput = requests/s meeting every SLO ({', '.join(slos)} ms), with their count" if slos else ""
    return "\n".join(lines) + ("\n\nLatencies in milliseconds; TTFT = time to first token, TPOT = time per output "
                               "token after the first, ITL = inter-token latency, E2E = end-to-end latency"
                               f"{note}.\n")


def _ms(value: float, digits: int) -> str:
    """A latency cell; "-" for one the result did not record (NaN: e.g. a vLLM result without e2el)."""
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def _goodput(s: dict) -> str:
    if "request_goodput" not in s:
        return "-"
    return f"{s['request_goodput']:.2f} ({s['good_requests']}/{s['completed'] + s['failed']})"


def _by_engine(results: list[dict]) -> dict[str, list[dict]]:
    engines: dict[str, list[dict]] = {}
    for label, run in _rows(results):
        engines.setdefault(label, []).append(run)
    return engines


def plot_results(results: list[dict], out_dir: str | Path) -> list[Path]:
    """Write throughput-vs-concurrency and TTFT/TPOT percentile plots as PNG files; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    engines = _by_engine(results)
    paths = [_plot_throughput(plt, engines, out / "throughput_vs_concurrency.png")]
    for lat in ("ttft", "tpot"):
        paths.append(_plot_percentiles(plt, engines, lat, out / f"{lat}_percentiles.png"))
    return paths


def _plot_throughput(plt, engines: dict[str, list[dict]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, runs in engines.items():
        runs = sorted(runs, key=lambda r: r.get("max_concurrency") or 0)
        xs = [r.get("max_concurrency") or r.get("peak_in_flight") or 0 for r in runs]
        ax.plot(xs, [r["summary"]["output_throughput"] for r in runs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ticks = sorted({r.get("max_concurrency") or r.get("peak_in_flight") or 0 for rs in engines.values() for r in rs})
    ax.set_xticks([t for t in ticks if t > 0], [str(t) for t in ticks if t > 0])
    ax.set(xlabel="max concurrency (requests in flight)", ylabel="output tokens / s",
           title="Output throughput vs concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_percentiles(plt, engines: dict[str, list[dict]], lat: str, path: Path) -> Path:
    """Grouped bars: one group per (engine, concurrency), one bar per statistic."""
    from matplotlib import ticker

    groups = [(f"{label}\nc={_concurrency(run)}", run) for label, runs in engines.items()
              for run in sorted(runs, key=lambda r: r.get("max_concurrency") or 0)]
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(groups)), 4.5))
    width = 0.8 / len(STATS)
    for i, stat in enumerate(STATS):
        xs = [g + (i - (len(STATS) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [run["summary"][f"{lat}_ms"][stat] for _, run in groups], width, label=stat)
    ax.set_xticks(range(len(groups)), [name for name, _ in groups], fontsize=8)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set(ylabel="milliseconds (log scale)", title=f"{_NAMES[lat]} ({lat.upper()}) per engine")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
