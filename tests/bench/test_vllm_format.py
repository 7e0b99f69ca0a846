"""Results in `vllm bench serve`'s format: heron's saved serve result carries vLLM's keys, and `heron bench
compare` and `cost` read files that vLLM wrote."""

from __future__ import annotations

import json
import math

import pytest

from heron.bench.client import RequestRecord
from heron.bench.result import load_result, make_result, save_result
from heron.bench.serve import LoadShape, RunResult

from .fake_openai import FakeConfig
from .test_bench_cli import cli

_STATS = [f"{stat}_{lat}_ms" for lat in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p99")]
# vLLM's top-level keys and their types (request_rate is a number or "inf"; max_concurrency may be null)
VLLM_TYPES = {
    "date": str, "backend": str, "model_id": str, "num_prompts": int, "request_rate": (float, str),
    "max_concurrency": (int, type(None)), "duration": float, "completed": int, "total_input_tokens": int,
    "total_output_tokens": int, "request_throughput": float, "output_throughput": float,
    "total_token_throughput": float, **dict.fromkeys(_STATS, float),
    "input_lens": list, "output_lens": list, "ttfts": list, "itls": list, "generated_texts": list, "errors": list,
}

# a result as `vllm bench serve --save-result --save-detailed` writes it (no e2el: vLLM's default
# --percentile-metrics is ttft,tpot,itl); one request failed
VLLM_RESULT = {
    "date": "20250601-120000", "endpoint_type": "openai", "backend": "openai", "label": None,
    "model_id": "org/model", "tokenizer_id": "org/model", "num_prompts": 4, "request_rate": "inf",
    "burstiness": 1.0, "max_concurrency": 4, "duration": 2.0, "completed": 3, "failed": 1,
    "total_input_tokens": 384, "total_output_tokens": 192, "request_throughput": 1.5, "request_goodput": None,
    "output_throughput": 96.0, "total_token_throughput": 288.0,
    "input_lens": [128] * 4, "output_lens": [64, 64, 64, 0], "ttfts": [0.1, 0.12, 0.11, 0.0],
    "itls": [[0.02] * 63] * 3 + [[]], "generated_texts": ["w1 w2"] * 3 + [""],
    "errors": ["", "", "", "Traceback (most recent call last):\n  ...\nServerDisconnectedError: Server disconnected"],
    "mean_ttft_ms": 110.0, "median_ttft_ms": 110.0, "std_ttft_ms": 8.2, "p99_ttft_ms": 119.8,
    "mean_tpot_ms": 20.0, "median_tpot_ms": 20.0, "std_tpot_ms": 0.1, "p99_tpot_ms": 20.3,
    "mean_itl_ms": 20.0, "median_itl_ms": 20.0, "std_itl_ms": 0.4, "p99_itl_ms": 21.0,
}


@pytest.fixture
def vllm_file(tmp_path):
    path = tmp_path / "openai-infqps-concurrency4-model-20250601-120000.json"
    path.write_text(json.dumps(VLLM_RESULT))
    return path


@pytest.mark.parametrize("fake_server", [FakeConfig(ttft_s=0.01, itl_s=0.002, faults={2: "500"})], indirect=True)
def test_saved_serve_result_has_every_vllm_key(fake_server, tokenizer_dir, tmp_path):
    out = tmp_path / "heron.json"
    assert cli("bench", "serve", "--base-url", fake_server.base_url, "--tokenizer", tokenizer_dir,
               "--input-len", 16, "--output-len", 8, "--num-prompts", 5, "--max-concurrency", 1,
               "--request-rate", 500, "--save-result", out, "--no-progress") == 0
    result = json.loads(out.read_text())
    for key, types in VLLM_TYPES.items():
        assert isinstance(result[key], types), (key, result[key])
    summary = result["runs"][0]["summary"]
    assert result["date"][8] == "-" and len(result["date"]) == 15  # %Y%m%d-%H%M%S
    assert (result["backend"], result["model_id"], result["num_prompts"]) == ("openai", "fake-model", 5)
    assert (result["request_rate"], result["max_concurrency"], result["completed"]) == (500.0, 1, 4)
    assert result["mean_ttft_ms"] == summary["ttft_ms"]["mean"] and result["p99_e2el_ms"] == summary["e2el_ms"]["p99"]
    assert result["output_lens"] == [8, 8, 0, 8, 8] and result["total_output_tokens"] == 32
    assert result["errors"][2].startswith("http_500") and result["errors"].count("") == 4
    assert all(isinstance(x, float) for x in result["ttfts"])
    assert [len(itl) for itl in result["itls"]] == [7, 7, 0, 7, 7]
    assert all(isinstance(x, float) for itl in result["itls"] for x in itl)
    assert all(0 < x < 1 for x in result["ttfts"][:2])  # seconds, as vLLM
    assert all(isinstance(n, int) for n in result["input_lens"] + result["output_lens"])
    assert all(isinstance(t, str) for t in result["generated_texts"]) and result["generated_texts"][0]

    # the vLLM keys alone are a vLLM result: read back, they give the same figures
    only_vllm = tmp_path / "only_vllm.json"
    only_vllm.write_text(json.dumps({k: v for k, v in result.items() if k not in ("format", "kind", "machine",
                                                                                  "config", "runs")}))
    back = load_result(only_vllm)["runs"][0]["summary"]
    for key in ("completed", "failed", "total_output_tokens", "output_throughput", "ttft_ms", "e2el_ms"):
        expected = {k: v for k, v in summary[key].items() if k != "p90"} if key.endswith("_ms") else summary[key]
        got = {k: v for k, v in back[key].items() if k != "p90"} if key.endswith("_ms") else back[key]
        assert got == expected, key


def test_a_vllm_result_is_read_as_a_serve_result(vllm_file):
    result = load_result(vllm_file)
    assert result["kind"] == "serve" and result["config"]["label"] == "vllm"
    (run,) = result["runs"]
    s = run["summary"]
    assert (run["max_concurrency"], run["request_rate"], s["completed"], s["failed"]) == (4, "inf", 3, 1)
    assert s["errors"] == {"ServerDisconnectedError: Server disconnected": 1}
    assert s["input_throughput"] == 192.0 and s["ttft_ms"]["p99"] == 119.8 and s["itl_ms"]["std"] == 0.4
    assert math.isnan(s["ttft_ms"]["p90"]) and math.isnan(s["e2el_ms"]["median"])  # not recorded by vLLM


def test_compare_and_cost_take_vllm_and_heron_results(vllm_file, tmp_path, capsys):
    records = [RequestRecord(128, 64, success=True, ttft=0.1, latency=1.4, itl=[0.02] * 63, output_tokens=64)] * 4
    heron = make_result("serve", {"label": "heron"}, [RunResult(LoadShape(max_concurrency=4), records, 2.0, 4).to_json()])
    heron_file = tmp_path / "heron.json"
    save_result(heron, heron_file)
    plots = tmp_path / "cmp"
    assert cli("bench", "compare", heron_file, vllm_file, "--out-dir", plots) == 0
    table = capsys.readouterr().out
    (vllm_row,) = [line for line in table.splitlines() if line.startswith("| vllm |")]
    assert vllm_row.split(" | ")[1:12] == ["4", "1.50", "96.0", "288.0", "110", "120", "20.0", "20.3", "21.0", "-",
                                           "-"]
    assert "| heron | 4 |" in table
    assert (plots / "ttft_percentiles.png").read_bytes()[:4] == b"\x89PNG"
    assert cli("bench", "cost", "--result", vllm_file, "--price-per-hour", 3.6) == 0
    assert "| vllm | 4 | 96.0 | 192.0 |" in capsys.readouterr().out


def test_appended_vllm_results_are_one_run_each(tmp_path):
    path = tmp_path / "appended.json"
    second = {**VLLM_RESULT, "max_concurrency": 8, "output_throughput": 150.0}
    path.write_text(json.dumps(VLLM_RESULT) + "\n" + json.dumps(second))  # as --append-result writes them
    runs = load_result(path)["runs"]
    assert [(r["max_concurrency"], r["summary"]["output_throughput"]) for r in runs] == [(4, 96.0), (8, 150.0)]
