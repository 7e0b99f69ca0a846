"""``vllm bench serve``'s result format, both ways: the top-level keys heron's serve results also carry (so vLLM's
tooling reads them), and vLLM's result files read as heron results (so ``heron bench compare`` and ``cost``
take them beside heron's own).

A vLLM result holds one run: its setup (``backend``, ``model_id``, ``request_rate``, ``max_concurrency``, ...),
totals and throughputs, ``{mean,median,std,p99}_{ttft,tpot,itl,e2el}_ms``, and the per-request lists
``input_lens``, ``output_lens``, ``ttfts`` (seconds), ``itls`` (a list of seconds per request),
``generated_texts`` and ``errors`` ("" for a success). vLLM's ``--append-result`` puts one JSON object per line.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import Counter
from typing import Any

from heron.bench.metrics import LATENCIES, STATS

DATE_FORMAT = "%Y%m%d-%H%M%S"  # vLLM's "date": local time, to the second
BACKENDS = {"/v1/completions": "openai", "/v1/chat/completions": "openai-chat"}  # vLLM's --backend names
VLLM_STATS = ("mean", "median", "std", "p99")  # vLLM's default --metric-percentiles is 99
# what a file must hold to be read as a vLLM result
REQUIRED = ("duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
            "output_throughput")


def vllm_fields(result: dict) -> dict[str, Any]:
    """vLLM's top-level keys for a heron serve result (``make_result`` of ``heron bench serve``), from its last
    run: vLLM's format holds one run, so a sweep's file describes its last point."""
    run, config = result["runs"][-1], result["config"]
    summary, requests = run["summary"], run["requests"]
    fields: dict[str, Any] = {
        "date": dt.datetime.fromisoformat(result["date"]).astimezone().strftime(DATE_FORMAT),
        "endpoint_type": BACKENDS[config["endpoint"]], "backend": BACKENDS[config["endpoint"]],
        "label": config["label"], "model_id": config["model"],
        "tokenizer_id": config["flags"].get("tokenizer") or config["model"], "num_prompts": len(requests),
        "request_rate": run["request_rate"], "burstiness": run["burstiness"],
        "max_concurrency": run["max_concurrency"],
        "duration": summary["duration_s"], "completed": summary["completed"], "failed": summary["failed"],
        "total_input_tokens": summary["total_input_tokens"], "total_output_tokens": summary["total_output_tokens"],
        "request_throughput": summary["request_throughput"], "request_goodput": summary.get("request_goodput"),
        "output_throughput": summary["output_throughput"],
        "total_token_throughput": summary["total_token_throughput"],
        "input_lens": [r["prompt_len"] for r in requests],
        "output_lens": [r["output_tokens"] if r["success"] else 0 for r in requests],
        "ttfts": [r["ttft"] for r in requests],
        "itls": [r["itl"] for r in requests],
        "generated_texts": [r["generated_text"] for r in requests],
        "errors": [_error_text(r) for r in requests],
    }
    for lat in LATENCIES:
        fields.update({f"{stat}_{lat}_ms": summary[f"{lat}_ms"][stat] for stat in VLLM_STATS})
    return fields


def _error_text(record: dict) -> str:
    if record["success"]:
        return ""
    return f"{record['error']}: {record['error_detail']}" if record["error_detail"] else record["error"]


def is_vllm_result(doc: Any) -> bool:
    """Whether ``doc`` (one parsed JSON object) is a ``vllm bench serve`` result."""
    return isinstance(doc, dict) and all(key in doc for key in REQUIRED)


def from_vllm(docs: list[dict]) -> tuple[dict, list[dict], str | None]:
    """The heron ``(config, runs, date)`` of vLLM result objects, one run each, in order."""
    first = docs[0]
    config = {"label": first.get("label") or "vllm", "engine": None, "model": first.get("model_id"),
              "endpoint": first.get("backend"), "source": "vllm bench serve"}
    return config, [_run(doc) for doc in docs], first.get("date")


def _run(doc: dict) -> dict:
    duration = max(doc["duration"], 1e-9)
    errors = [_error_kind(e) for e in doc.get("errors") or [] if e]
    failed = doc.get("failed", len(errors))  # older vLLM files have no "failed"
    inp, out = doc["total_input_tokens"], doc["total_output_tokens"]
    summary = {
        "completed": doc["completed"], "failed": failed,
        "errors": dict(Counter(errors)) if errors else ({"error": failed} if failed else {}),
        "duration_s": doc["duration"], "total_input_tokens": inp, "total_output_tokens": out,
        "request_throughput": doc["request_throughput"], "input_throughput": inp / duration,
        "output_throughput": doc["output_throughput"],
        "total_token_throughput": doc.get("total_token_throughput", (inp + out) / duration),
    }
    for lat in LATENCIES:  # statistics vLLM did not record (p90; e2el unless asked for) are NaN
        summary[f"{lat}_ms"] = {stat: _number(doc.get(f"{stat}_{lat}_ms")) for stat in (*STATS, "std")}
    return {"max_concurrency": doc.get("max_concurrency"), "request_rate": doc.get("request_rate", "inf"),
            "burstiness": doc.get("burstiness", 1.0), "peak_in_flight": doc.get("max_concurrent_requests"),
            "summary": summary}


def _error_kind(error: str) -> str:
    """A short name for one of vLLM's error texts (an HTTP reason, or a traceback whose last line names it)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1][:80] if lines else "error"


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else math.nan
