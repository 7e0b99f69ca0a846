"""Cost arithmetic: $ per million tokens from a measured throughput and a machine's hourly price."""

from __future__ import annotations

from dataclasses import dataclass

from heron.bench.result import engine_label
from heron.errors import ConfigError

SECONDS_PER_DAY = 86_400


def cost_per_million(tokens_per_s: float, price_per_hour: float) -> float:
    """$ per million tokens for a machine at ``price_per_hour`` kept busy at ``tokens_per_s``."""
    if tokens_per_s <= 0:
        raise ConfigError("throughput must be positive to price it")
    return price_per_hour / (tokens_per_s * 3600.0) * 1e6


def cost_per_million_per_day(tokens_per_day: float, price_per_hour: float) -> float:
    """$ per million tokens for one machine billed all day that serves ``tokens_per_day``."""
    if tokens_per_day <= 0:
        raise ConfigError("--tokens-per-day must be positive")
    return price_per_hour * 24.0 / tokens_per_day * 1e6


@dataclass
class CostRow:
    """The cost of one measured run."""

    engine: str
    concurrency: str
    output_tok_s: float
    input_tok_s: float
    output_tokens_per_day: float
    usd_per_m_output: float
    usd_per_m_total: float
    api_usd_per_m_output: float | None = None
    saving: float | None = None


def cost_rows(result: dict, price_per_hour: float, api_in: float | None = None,
              api_out: float | None = None) -> list[CostRow]:
    """One CostRow per run of ``result``.

    $/M output charges the whole machine to output tokens; $/M total spreads it over input + output. With API
    prices, the API's bill for the same token mix is ``api_out + api_in * input/output`` per million output
    tokens, and the saving is ``1 - ours / api``.
    """
    if price_per_hour <= 0:
        raise ConfigError("--price-per-hour must be positive")
    rows = []
    for run in result["runs"]:
        s = run["summary"]
        out_s, in_s = s["output_throughput"], s["input_throughput"]
        if out_s <= 0:
            continue
        row = CostRow(engine_label(result), str(run.get("max_concurrency") or "unbounded"), out_s, in_s,
                      out_s * SECONDS_PER_DAY, cost_per_million(out_s, price_per_hour),
                      cost_per_million(out_s + in_s, price_per_hour))
        if api_out is not None:
            row.api_usd_per_m_output = api_out + (api_in or 0.0) * in_s / out_s
            row.saving = 1.0 - row.usd_per_m_output / row.api_usd_per_m_output
        rows.append(row)
    if not rows:
        raise ConfigError("the result has no run with a positive output throughput to price")
    return rows


def cost_table(rows: list[CostRow], price_per_hour: float) -> str:
    """A markdown table of cost rows."""
    api = any(r.api_usd_per_m_output is not None for r in rows)
    head = ["engine", "concurrency", "out tok/s", "in tok/s", "out tokens/day", "$/M out", "$/M in+out"]
    head += ["API $/M out (same mix)", "saving"] if api else []
    lines = [f"Machine at ${price_per_hour:g}/h (${price_per_hour * 24:.2f}/day)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.engine, r.concurrency, f"{r.output_tok_s:.1f}", f"{r.input_tok_s:.1f}",
                 f"{r.output_tokens_per_day / 1e6:.1f}M", f"{r.usd_per_m_output:.3f}", f"{r.usd_per_m_total:.3f}"]
        if api:
            cells += [f"{r.api_usd_per_m_output:.3f}", f"{r.saving:.1%}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
