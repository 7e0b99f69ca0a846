"""Shared helpers of the benchmark scripts: machine description and result files."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "loadavg_1m": os.getloadavg()[0],
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def save(name: str, result: dict) -> Path:
    path = RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), **result}, indent=2))
    print(f"wrote {path}")
    return path


def load_hf_model(model: str, dtype: torch.dtype = torch.float32):
    """The transformers model, in ``dtype``, on the same files heron loads (a GGUF through ``gguf_file=``)."""
    from transformers import AutoModelForCausalLM

    from heron.bench.resolve import resolve_model_files

    files = resolve_model_files(model)
    return AutoModelForCausalLM.from_pretrained(str(files.directory), dtype=dtype,
                                                **files.hf_kwargs()).eval()
