"""The bench command line end to end: serve against the fake server, then compare and cost on its result."""

from __future__ import annotations

import argparse
import json

import pytest

from heron.bench.cli import add_baseline_parser, add_parser
from heron.errors import ConfigError

from .fake_openai import FakeConfig


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="heron")
    sub = parser.add_subparsers()
    add_parser(sub)
    add_baseline_parser(sub)
    return parser


def cli(*argv: str):
    args = _parser().parse_args([str(a) for a in argv])
    return args.func(args)


@pytest.mark.parametrize("fake_server", [FakeConfig(ttft_s=0.01, itl_s=0.002)], indirect=True)
def test_serve_result_round_trips_through_compare_and_cost(fake_server, tokenizer_dir, tmp_path, capsys):
    out = tmp_path / "fake.json"
    rc = cli("bench", "serve", "--base-url", fake_server.base_url, "--tokenizer", tokenizer_dir,
             "--input-len", 16, "--output-len", 8, "--num-prompts", 6, "--warmup", 2, "--sweep-concurrency", "1,3",
             "--goodput", "ttft:500", "tpot:50", "--save-result", out, "--no-progress")
    assert rc == 0
    printed = capsys.readouterr().out
    assert "fake-engine: serving benchmark" in printed and "Request goodput" in printed
    result = json.loads(out.read_text())
    assert result["kind"] == "serve" and result["date"] and result["machine"]["cpu_count"] >= 1
    config = result["config"]
    assert (config["label"], config["model"], config["dataset"]["num_prompts"]) == ("fake-engine", "fake-model", 6)
    assert config["flags"]["sweep_concurrency"] == [1, 3] and config["flags"]["request_rate"] == "inf"
    assert [run["max_concurrency"] for run in result["runs"]] == [1, 3]
    for run in result["runs"]:
        assert len(run["requests"]) == 6 and run["summary"]["completed"] == 6
        assert run["summary"]["good_requests"] == 6
        assert all(r["output_tokens"] == 8 and len(r["itl"]) == 7 for r in run["requests"])
    assert fake_server.received == 2 + 12

    plots = tmp_path / "cmp"
    assert cli("bench", "compare", out, out, "--out-dir", plots) == 0
    table = (plots / "comparison.md").read_text()
    assert table.count("| fake-engine | 3 |") == 2
    for name in ("throughput_vs_concurrency.png", "ttft_percentiles.png", "tpot_percentiles.png"):
        assert (plots / name).read_bytes()[:4] == b"\x89PNG"

    capsys.readouterr()
    assert cli("bench", "cost", "--result", out, "--price-per-hour", 6.76, "--api-price-in", 5,
               "--api-price-out", 15) == 0
    cost = capsys.readouterr().out
    out_tok_s = result["runs"][1]["summary"]["output_throughput"]
    assert f"{6.76 / (out_tok_s * 3600) * 1e6:.3f}" in cost and "saving" in cost


def test_cost_from_a_throughput_given_by_hand(capsys):
    assert cli("bench", "cost", "--tokens-per-second", 3000, "--price-per-hour", 6.76,
               "--tokens-per-day", 300e6) == 0
    out = capsys.readouterr().out
    assert "259.2M tokens/day" in out and "$0.626 per million" in out and "$0.541 per million" in out


def test_compare_rejects_files_that_are_not_results(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ConfigError, match="not a heron bench result"):
        cli("bench", "compare", bad)


def test_serve_reports_an_unreachable_server(tmp_path):
    with pytest.raises(ConfigError, match="cannot reach"):
        cli("bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--timeout", 2)


@pytest.mark.parametrize("argv", [["bench"], ["bench", "serve"], ["bench", "throughput"], ["bench", "latency"],
                                  ["bench", "compare"], ["bench", "cost"], ["baseline"], ["baseline", "hf"],
                                  ["baseline", "llamacpp"]])
def test_every_subcommand_has_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args([*argv, "--help"])
    assert exit_.value.code == 0
    assert "usage: heron" in capsys.readouterr().out
