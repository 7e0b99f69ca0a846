"""Result files: a run's configuration (engine, model, flags, machine, date) plus its runs, as JSON.

Serve results also carry ``vllm bench serve``'s top-level keys (``vllm_format.py``), and ``load_result`` reads
vLLM's result files too.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shutil
import subprocess
from pathlib import Path

from heron.errors import ConfigError

FORMAT = "heron-bench/1"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return round(pages * size / 2**30, 1)


def _gpus() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def machine_info() -> dict:
    """What the numbers were measured on: CPU model, cores, memory, GPUs, OS, Python, and the load average
    (1, 5, 15 min) when measured, since other work on the machine skews every figure."""
    load = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    return {"cpu": _cpu_model(), "cpu_count": os.cpu_count(), "memory_gib": _memory_gib(), "gpus": _gpus(),
            "os": platform.platform(), "python": platform.python_version(), "hostname": platform.node(),
            "load_average": load}


def now_iso() -> str:
    """The current UTC time, ISO 8601, to the second."""
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat()


def make_result(kind: str, config: dict, runs: list[dict], machine: dict | None = None,
                date: str | None = None) -> dict:
    """A result document; ``machine`` and ``date`` (taken when the run started) default to now."""
    return {"format": FORMAT, "kind": kind, "date": date or now_iso(), "machine": machine or machine_info(),
            "config": config, "runs": runs}


def save_result(result: dict, path: str | Path) -> Path:
    """Write ``result`` as indented JSON, creating parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return path


def load_result(path: str | Path) -> dict:
    """Read a result file written by ``heron bench serve --save-result``, or by ``vllm bench serve
    --save-result`` (as a heron serve result, one run per vLLM result); ConfigError if it is neither."""
    from heron.bench.vllm_format import from_vllm, is_vllm_result  # it builds on this module

    docs = _json_objects(path)
    result = docs[0]
    if len(docs) == 1 and isinstance(result, dict) and result.get("format") == FORMAT and result.get("runs"):
        return result
    if all(is_vllm_result(doc) for doc in docs):
        config, runs, date = from_vllm(docs)
        return {"format": FORMAT, "kind": "serve", "date": date, "machine": {}, "config": config, "runs": runs}
    raise ConfigError(f"{path} is not a heron bench result (expected format {FORMAT!r} with runs) nor a "
                      "`vllm bench serve` result")


def _json_objects(path: str | Path) -> list:
    """The JSON document in ``path``, or its lines' documents (vLLM's ``--append-result`` writes one a line)."""
    try:
        text = Path(path).read_text()
        try:
            return [json.loads(text)]
        except json.JSONDecodeError as whole:
            lines = [json.loads(line) for line in text.splitlines() if line.strip()]
            if not lines:
                raise whole from None
            return lines
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read result file {path}: {e}") from e


def engine_label(result: dict) -> str:
    """The engine name a result is shown under."""
    return str(result.get("config", {}).get("label") or result.get("config", {}).get("engine") or "unknown")
