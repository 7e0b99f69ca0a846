"""Weight quantization on the default model, one mode after another in one run: weight memory, KV tokens in a
fixed budget, decode speed through ``heron bench serve``, perplexity and greedy agreement; and llama.cpp on the same
Q4_1 GGUF file (``llama-perplexity`` and ``llama-server``) as the yardstick.

    python -m benchmarks.bench_quant [--modes fp32,bf16,gguf,int8,int4,fp8,bf16-fp8kv] [--num-prompts 32]
                                     [--concurrency 1,32] [--kv-cache-memory 512MiB] [--ppl-ctx 512]
                                     [--no-llamacpp] [--write-docs]
    python -m benchmarks.bench_quant --from-result benchmarks/results/quant-DATE/quant_TIME.json --write-docs

Modes (each also ``--dtype`` bfloat16 unless said):

- ``fp32`` / ``bf16``: ``--quantization none``: the GGUF dequantized to float32 / bfloat16.
- ``gguf``: ``--quantization gguf``: the file's Q4_1 blocks kept quantized (heron's CPU default for a GGUF).
- ``int8`` / ``int4`` / ``fp8``: the GGUF's dequantized weights requantized at load. There is no full-precision
  SmolLM2 checkpoint offline, so every mode, bf16 included, starts from the Q4_1 file's weights: "quality vs bf16"
  measures what a mode adds on top of Q4_1, not the loss from the original model.
- ``bf16-fp8kv``: ``bf16`` with ``--kv-cache-dtype fp8``.

Per mode: weights (``heron.quantization.summary.weight_bytes``: the weights as served), KV tokens (blocks x block size) in ``--kv-cache-memory``, and the perplexity and greedy outputs
through ``LLM`` in this process; then a ``heron serve`` started with the same flags and measured at each
``--concurrency`` (random prompts of ``--input-len`` tokens, ``--output-len`` output tokens; the same prompts for
every mode and for llama-server).

Perplexity uses llama-perplexity's windows exactly, so heron's and llama.cpp's figures are comparable: the text's
tokens are cut into ``len // ppl_ctx`` consecutive chunks of ``ppl_ctx`` tokens (the rest is dropped; a BOS
replaces each chunk's first token when the model adds one), each chunk is evaluated from an empty cache, and only
the second half is scored: the tokens at positions ``ppl_ctx/2 + 1 .. ppl_ctx - 1`` of each chunk, each predicted
from every token before it in the chunk. heron gets the log probabilities from ``SamplingParams(prompt_logprobs=0,
max_tokens=1)`` (``perplexity``); with ``--ppl-step-tokens N`` also at most N tokens per engine step
(``perplexity_prefill`` then holds the default budget's figure). heron's integer kernel computes each row the same
way at any batch size, so the step budget changes nothing for packed weights (a check, not a second measure).

The greedy outputs are taken at the same step budget as the headline perplexity.

A mode that fails (e.g. not built yet) is recorded with its error and the run goes on; the JSON is rewritten after
every mode, under ``benchmarks/results/quant-<date>/``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import gc
import json
import logging
import math
import re
import shlex
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

logger = logging.getLogger("benchmarks.bench_quant")

ROOT = Path(__file__).resolve().parent.parent
TEXT = Path(__file__).resolve().parent / "data" / "quality_text.txt"
RESULTS = Path(__file__).resolve().parent / "results"
DOCS = ROOT / "docs" / "benchmarks.md"
DOCS_HEADING = "## Quantization"
FORMAT = "heron-bench-quant/1"
LLAMACPP = "llama.cpp"
LLAMACPP_TARGETS = ("llama-server", "llama-perplexity", "llama-tokenize")
NO_CHECKPOINT_NOTE = ("There is no full-precision SmolLM2 checkpoint offline: every mode starts from the Q4_1 GGUF. "
                      "fp32 and bf16 are its weights dequantized; int8, int4 and fp8 requantize those dequantized "
                      "weights at load; gguf keeps the file's Q4_1 blocks. So 'vs bf16' measures what a mode adds on "
                      "top of Q4_1, not the loss from the original model.")


@dataclasses.dataclass(frozen=True)
class Mode:
    """One way to run the model: the engine flags it differs by."""

    name: str
    dtype: str
    quantization: str
    kv_cache_dtype: str = "auto"
    label: str = ""

    def engine_args(self) -> dict[str, str]:
        """``LLM``/``EngineConfig`` keyword arguments of this mode."""
        return {"dtype": self.dtype, "quantization": self.quantization, "kv_cache_dtype": self.kv_cache_dtype}

    def serve_flags(self) -> list[str]:
        """The same as ``heron serve`` flags."""
        return [f"--{k.replace('_', '-')}={v}" for k, v in self.engine_args().items()]


MODES = {m.name: m for m in (
    Mode("fp32", "float32", "none", label="fp32 (dequantized)"),
    Mode("bf16", "bfloat16", "none", label="bf16 (dequantized)"),
    Mode("gguf", "bfloat16", "gguf", label="gguf (Q4_1 kept)"),
    Mode("int8", "bfloat16", "int8", label="int8"),
    Mode("int4", "bfloat16", "int4", label="int4"),
    Mode("fp8", "bfloat16", "fp8", label="fp8"),
    Mode("bf16-fp8kv", "bfloat16", "none", "fp8", label="bf16 + fp8 KV"),
)}
REFERENCE = "bf16"


# ---------------------------------------------------------------------------------------------------------------
# errors


@contextlib.contextmanager
def recording(errors: list[dict], phase: str) -> Iterator[None]:
    """Run the block; if it raises (SystemExit included), append ``{"phase", "error", "traceback"}`` to ``errors``
    and carry on after the block: one failing mode or phase must never end the run. KeyboardInterrupt passes."""
    try:
        yield
    except (Exception, SystemExit) as e:
        text = f"{type(e).__name__}: {e}"
        logger.error("%s failed: %s", phase, text)
        errors.append({"phase": phase, "error": text, "traceback": traceback.format_exc(limit=-6)})


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------------------------
# the text and llama-perplexity's windows


def load_text(path: Path = TEXT) -> str:
    """The scored text: the file without its license header (leading ``#`` lines and the blank line after them)
    and without trailing newlines (llama-perplexity drops a final newline; the body heron and llama.cpp score is
    written out without one)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    while lines and not lines[0].strip():
        lines.pop(0)
    return "\n".join(lines).rstrip("\n")


@dataclasses.dataclass(frozen=True)
class Window:
    """One llama-perplexity chunk: its tokens and the positions in it that are scored."""

    start: int  # offset of the chunk's first token in the text's tokens
    tokens: list[int]
    first_scored: int  # positions first_scored .. len(tokens) - 1 are scored

    @property
    def num_scored(self) -> int:
        return len(self.tokens) - self.first_scored


def perplexity_windows(tokens: Sequence[int], n_ctx: int, bos_id: int | None = None,
                       max_chunks: int | None = None) -> list[Window]:
    """llama-perplexity's chunks of ``tokens`` (the text tokenized as llama.cpp does: BOS first if the model adds
    one): ``len(tokens) // n_ctx`` consecutive chunks of ``n_ctx`` tokens (at most ``max_chunks``, its ``--chunks``),
    the remainder dropped; with ``bos_id`` each chunk's first token is replaced by BOS; the scored positions are
    ``n_ctx // 2 + 1 .. n_ctx - 1`` (the logits of positions ``n_ctx // 2 .. n_ctx - 2``). Like llama-perplexity,
    refuses a text under ``2 * n_ctx`` tokens."""
    if n_ctx < 4:
        raise ValueError(f"the perplexity context must be at least 4 tokens, got {n_ctx}")
    if len(tokens) < 2 * n_ctx:
        raise ValueError(f"the text has {len(tokens)} tokens; a context of {n_ctx} needs at least {2 * n_ctx}")
    n_chunks = len(tokens) // n_ctx if not max_chunks else min(max_chunks, len(tokens) // n_ctx)
    windows = []
    for start in range(0, n_chunks * n_ctx, n_ctx):
        chunk = list(tokens[start:start + n_ctx])
        if bos_id is not None:
            chunk[0] = bos_id
        windows.append(Window(start, chunk, n_ctx // 2 + 1))
    return windows


def token_logprobs(prompt_logprobs: Sequence[Any], token_ids: Sequence[int]) -> list[float | None]:
    """Each prompt token's log probability given the tokens before it (None for the first), from vLLM-style
    ``RequestOutput.prompt_logprobs`` (per position ``None`` or ``{token_id: Logprob}``; a float also accepted)."""
    if len(prompt_logprobs) != len(token_ids):
        raise ValueError(f"{len(prompt_logprobs)} prompt logprobs for {len(token_ids)} prompt tokens")
    out: list[float | None] = []
    for pos, (entry, token) in enumerate(zip(prompt_logprobs, token_ids, strict=True)):
        if entry is None:
            out.append(None)
            continue
        if token not in entry:
            raise ValueError(f"position {pos}: the prompt logprobs lack the prompt's own token {token}")
        value = entry[token]
        out.append(float(getattr(value, "logprob", value)))
    return out


def perplexity(windows: Sequence[Window], logprobs: Sequence[Sequence[float | None]]) -> dict:
    """Perplexity over the windows' scored positions from per-position log probabilities (``token_logprobs`` of
    each window): exp of the mean negative log-likelihood, and llama-perplexity's "+/-" (the standard error of the
    mean NLL, times the perplexity)."""
    if len(windows) != len(logprobs):
        raise ValueError(f"{len(windows)} windows but {len(logprobs)} logprob lists")
    nll = nll2 = 0.0
    count = 0
    for window, lps in zip(windows, logprobs, strict=True):
        if len(lps) != len(window.tokens):
            raise ValueError(f"window at {window.start}: {len(lps)} logprobs for {len(window.tokens)} tokens")
        for pos in range(window.first_scored, len(window.tokens)):
            value = lps[pos]
            if value is None:
                raise ValueError(f"window at {window.start}: no logprob at scored position {pos}")
            nll -= value
            nll2 += value * value
            count += 1
    if not count:
        raise ValueError("no scored positions")
    mean = nll / count
    var = nll2 / count - mean * mean
    ppl = math.exp(mean)
    stderr = math.sqrt(var / (count - 1)) * ppl if var > 0 and count > 1 else 0.0
    return {"ppl": ppl, "ppl_stderr": stderr, "mean_nll": mean, "tokens_scored": count, "windows": len(windows)}


_LLAMA_PPL = re.compile(r"Final estimate: PPL = ([0-9.eE+-]+|nan|inf) \+/- ([0-9.eE+-]+|nan|inf)")
_LLAMA_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)")


def parse_llamacpp_perplexity(output: str) -> dict:
    """The final estimate (and chunking) from llama-perplexity's log; ValueError if it printed none."""
    found = _LLAMA_PPL.search(output)
    if not found:
        raise ValueError("llama-perplexity printed no final estimate; last lines:\n"
                         + "\n".join(output.splitlines()[-8:]))
    result: dict[str, Any] = {"ppl": float(found.group(1)), "ppl_stderr": float(found.group(2))}
    chunks = _LLAMA_CHUNKS.search(output)
    if chunks:
        n_chunks, n_ctx = int(chunks.group(1)), int(chunks.group(2))
        result.update(windows=n_chunks, n_ctx=n_ctx, tokens_scored=n_chunks * (n_ctx - n_ctx // 2 - 1))
    return result


def compare_tokens(heron: Sequence[int], llamacpp: Sequence[int]) -> dict:
    """Whether heron's tokenizer gives llama.cpp's ids for the text (else the windows would not be the same)."""
    first = next((i for i, (a, b) in enumerate(zip(heron, llamacpp, strict=False)) if a != b), None)
    if first is None and len(heron) != len(llamacpp):
        first = min(len(heron), len(llamacpp))
    return {"heron_tokens": len(heron), "llamacpp_tokens": len(llamacpp), "identical": first is None,
            "first_difference": first}


# ---------------------------------------------------------------------------------------------------------------
# greedy agreement


def agreement_prompts(tokens: Sequence[int], num: int, length: int) -> list[list[int]]:
    """``num`` prompts of ``length`` tokens taken from the text at evenly spaced offsets."""
    if len(tokens) < length:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than one prompt of {length}")
    last = len(tokens) - length
    offsets = [round(i * last / max(num - 1, 1)) for i in range(num)]
    return [list(tokens[o:o + length]) for o in offsets]


def greedy_agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> dict:
    """How far greedy outputs follow the reference's: the fraction of positions holding the same token (position
    by position, over the longer of each pair: a missing token counts as different), the mean length of the common
    prefix, and how many outputs are identical."""
    if len(reference) != len(other):
        raise ValueError(f"{len(reference)} reference outputs but {len(other)} to compare")
    if not reference:
        raise ValueError("no outputs to compare")
    same = positions = 0
    prefixes = []
    for ref, out in zip(reference, other, strict=True):
        positions += max(len(ref), len(out))
        same += sum(a == b for a, b in zip(ref, out, strict=False))
        prefix = next((i for i, (a, b) in enumerate(zip(ref, out, strict=False)) if a != b), min(len(ref), len(out)))
        prefixes.append(prefix)
    return {"token_agreement": same / positions if positions else 1.0,
            "mean_common_prefix": sum(prefixes) / len(prefixes),
            "identical_outputs": sum(len(r) == len(o) == p for r, o, p in zip(reference, other, prefixes,
                                                                                strict=True)),
            "outputs": len(reference), "tokens_per_output": max((len(r) for r in reference), default=0)}


# ---------------------------------------------------------------------------------------------------------------
# serving figures


def serving_figures(doc: dict) -> dict[str, dict]:
    """Per concurrency (as a string key) of a ``heron bench serve`` result: the decode rate and what it comes from.

    ``decode_tok_s`` = streams x 1000 / median TPOT, with streams = min(concurrency, completed requests): tokens per
    second while that many streams decode (TPOT excludes each request's own prefill; at concurrency 1 it is the
    single-stream decode speed). ``output_tok_s`` is all output tokens over the run's wall time (prefill included).
    """
    figures = {}
    for run in doc["runs"]:
        s = run["summary"]
        concurrency = run.get("max_concurrency") or s["completed"]
        tpot = s["tpot_ms"]["median"]
        per_stream = 1000.0 / tpot if s["completed"] and tpot > 0 else None
        streams = min(concurrency, s["completed"])
        figures[str(concurrency)] = {
            "decode_tok_s": per_stream * streams if per_stream else None,
            "decode_tok_s_per_stream": per_stream, "output_tok_s": s["output_throughput"],
            "tpot_p50_ms": tpot, "ttft_p50_ms": s["ttft_ms"]["median"], "completed": s["completed"],
            "failed": s["failed"], "errors": s["errors"]}
    return figures


# ---------------------------------------------------------------------------------------------------------------
# targets and tables


def _get(doc: dict | None, *keys: str) -> Any:
    for key in keys:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(key)
    return doc


def evaluate_targets(result: dict) -> list[dict]:
    """The issue's targets, each ``{"target", "mode", "measured", "pass"}`` (pass None: a figure is missing)."""
    modes = result.get("modes", {})
    llama = result.get("llamacpp")
    conc = [str(c) for c in result.get("config", {}).get("concurrency", [1, 32])]
    low, high = conc[0], conc[-1]
    rows: list[dict] = []

    def ppl(name: str) -> float | None:
        return _get(llama if name == LLAMACPP else modes.get(name), "perplexity", "ppl")

    def decode(name: str, c: str) -> float | None:
        return _get(llama if name == LLAMACPP else modes.get(name), "serving", c, "decode_tok_s")

    def present(name: str) -> bool:
        return llama is not None if name == LLAMACPP else name in modes

    def add(target: str, mode: str, needs: Sequence[str], value: float | None, ref: float | None,
            check: Any, show: Any) -> None:
        if not all(present(n) for n in needs):
            return
        if value is None or ref is None or not ref:
            missing = [mode] * (value is None) + [n for n in needs if n != mode] * (ref is None or not ref)
            rows.append({"target": target, "mode": mode, "measured": f"n/a (no figure from {', '.join(missing)})",
                         "pass": None})
            return
        ratio = value / ref
        rows.append({"target": target, "mode": mode, "measured": show(ratio), "ratio": ratio,
                     "pass": bool(check(ratio))})

    def pct(ratio: float) -> str:
        return f"{(ratio - 1) * 100:+.2f}%"

    def times(ratio: float) -> str:
        return f"{ratio:.2f}x"

    for mode, limit in (("fp8", 0.02), ("int8", 0.02), ("int4", 0.05), ("gguf", 0.05), ("bf16-fp8kv", 0.01)):
        add(f"perplexity within {limit:.0%} of bf16", mode, [mode, REFERENCE], ppl(mode), ppl(REFERENCE),
            lambda r, lim=limit: abs(r - 1) <= lim, pct)
    add("perplexity within 1% of llama.cpp's on the same file", "gguf", ["gguf", LLAMACPP], ppl("gguf"),
        ppl(LLAMACPP), lambda r: abs(r - 1) <= 0.01, pct)
    add("fp8 KV holds 2x the tokens of bf16 KV", "bf16-fp8kv", ["bf16-fp8kv", REFERENCE],
        _get(modes.get("bf16-fp8kv"), "kv", "tokens"), _get(modes.get(REFERENCE), "kv", "tokens"),
        lambda r: r >= 2.0, times)
    add(f"decode at concurrency {low} >= 1.3x llama-server's", "gguf", ["gguf", LLAMACPP], decode("gguf", low),
        decode(LLAMACPP, low), lambda r: r >= 1.3, times)
    add(f"decode at concurrency {high} no slower than bf16", "gguf", ["gguf", REFERENCE], decode("gguf", high),
        decode(REFERENCE, high), lambda r: r >= 1.0, times)
    return rows


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _verdict(passed: bool | None) -> str:
    return {True: "PASS", False: "FAIL", None: "n/a"}[passed]


def _errors_cell(errors: Sequence[dict]) -> str:
    text = "; ".join(f"{e['phase']}: {e['error'].splitlines()[0][:120]}" for e in errors)
    return text.replace("|", "/") or "-"


def render_table(result: dict) -> str:
    """The markdown tables: one row per mode (and llama.cpp), then the targets with their verdicts."""
    modes = result.get("modes", {})
    conc = [str(c) for c in result.get("config", {}).get("concurrency", [1, 32])]
    budget = result.get("config", {}).get("kv_cache_memory", "?")
    targets = result.get("targets") or evaluate_targets(result)
    ref_ppl = _get(modes.get(REFERENCE), "perplexity", "ppl")
    step = result.get("config", {}).get("ppl_step_tokens", "?")
    ppl_head = "perplexity" if step in (None, "?") else f"perplexity (≤{step}-row steps)"
    head = (["mode", "weights MiB", f"KV tokens in {budget}", ppl_head,
             "vs bf16", "perplexity (default steps)", "greedy = bf16 (tokens)", "common prefix"]
            + [f"decode tok/s c={c}" for c in conc] + [f"out tok/s c={conc[-1]}", "targets", "errors"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def ppl_cells(doc: dict | None) -> list[str]:
        value = _get(doc, "perplexity", "ppl")
        err = _get(doc, "perplexity", "ppl_stderr")
        shown = "-" if value is None else f"{value:.3f}" + (f" ± {err:.3f}" if err else "")
        vs = "-" if value is None or not ref_ppl else f"{(value / ref_ppl - 1) * 100:+.2f}%"
        return [shown, vs, _num(_get(doc, "perplexity_prefill", "ppl"), 3)]

    def speed_cells(doc: dict | None) -> list[str]:
        return ([_num(_get(doc, "serving", c, "decode_tok_s")) for c in conc]
                + [_num(_get(doc, "serving", conc[-1], "output_tok_s"))])

    def target_cell(name: str) -> str:
        mine = [t for t in targets if t["mode"] == name]
        return "<br>".join(f"{t['target']}: {_verdict(t['pass'])}" for t in mine) or "-"

    for name, doc in modes.items():
        weights = _get(doc, "weights", "served_mib")
        wcell = "-" if weights is None else f"{weights:.1f}"
        agree = _get(doc, "agreement", "token_agreement")
        prefix = _get(doc, "agreement", "mean_common_prefix")
        outs = _get(doc, "agreement", "tokens_per_output")
        kv = _get(doc, "kv", "tokens")
        cells = ([MODES[name].label if name in MODES else name, wcell, "-" if kv is None else f"{kv:,}",
                  *ppl_cells(doc), "-" if agree is None else f"{agree:.1%}",
                  "-" if prefix is None else f"{prefix:.1f} / {outs}", *speed_cells(doc), target_cell(name),
                  _errors_cell(doc.get("errors", []))])
        lines.append("| " + " | ".join(cells) + " |")
    llama = result.get("llamacpp")
    if llama is not None:
        size = _get(llama, "gguf_mib")
        cells = [f"llama.cpp ({llama.get('gguf_type', 'Q4_1')} file)", "-" if size is None else f"{size:.1f} (file)",
                 "-", *ppl_cells(llama), "-", "-", *speed_cells(llama), target_cell(LLAMACPP),
                 _errors_cell(llama.get("errors", []))]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| target | mode | measured | result |", "|---|---|---|---|"]
    lines += [f"| {t['target']} | {t['mode']} | {t['measured']} | **{_verdict(t['pass'])}** |" for t in targets]
    return "\n".join(lines) + "\n"


def _settings_text(result: dict) -> str:
    cfg, m = result.get("config", {}), result.get("machine", {})
    loads = "/".join(str(x) for x in (m.get("load_average") or [])) or "unknown"
    loads_end = "/".join(str(x) for x in (result.get("load_average_end") or [])) or "unknown"
    llama = result.get("llamacpp") or {}
    tok = _get(llama, "tokenization", "identical")
    same = {True: "heron's tokenizer gives llama.cpp's ids for the text", False: "**heron's and llama.cpp's token ids "
            "differ** (see the JSON)", None: "token ids not compared with llama.cpp"}[tok]
    conc = ", ".join(str(c) for c in cfg.get("concurrency", []))
    when = str(result.get("date", "?")).replace("T", " ")[:16]
    return "\n".join([
        f"Measured {when} UTC with `{cfg.get('command', 'python -m benchmarks.bench_quant')}` on "
        f"{m.get('cpu', '?')} ({m.get('cpu_count', '?')} cores, {cfg.get('threads', '?')} threads for heron and "
        f"llama.cpp alike), torch {m.get('torch', '?')}; load average 1/5/15 min {loads} at the start, {loads_end} "
        f"at the end. Results: `{cfg.get('result_file', '?')}`.",
        "",
        f"- **Model**: `{cfg.get('model', '?')}`, the Q4_1 GGUF. {NO_CHECKPOINT_NOTE}",
        f"- **Weights**: `weight_bytes` of the loaded model (the weights as served). **KV tokens**: blocks x block size in "
        f"`--kv-cache-memory {cfg.get('kv_cache_memory', '?')}`.",
        f"- **Perplexity** of `benchmarks/data/quality_text.txt` ({cfg.get('text_tokens', '?')} tokens, original CC0 "
        f"prose) in llama-perplexity's windows, for heron and llama.cpp alike: {cfg.get('ppl_windows', '?')} chunks "
        f"of {cfg.get('ppl_ctx', '?')} tokens, each from an empty cache, scoring the second half of each "
        f"({cfg.get('ppl_tokens_scored', '?')} tokens in all); ± is llama-perplexity's standard error (of the text's "
        f"mean NLL; two modes scoring the same tokens differ far less than it); {same}. Packed modes multiply through "
        "heron's int8-dot kernel at every step size (8-bit activations per 32 inputs, as llama.cpp's). "
        "llama.cpp: `llama-perplexity` on the GGUF file.",
        f"- **Greedy = bf16**: {cfg.get('agreement_prompts', '?')} prompts of {cfg.get('agreement_prompt_len', '?')} "
        f"tokens from the same text, {cfg.get('agreement_tokens', '?')} greedy tokens each (ignore EOS): "
        "the fraction of positions holding bf16's token, and the "
        "mean common prefix with bf16's output.",
        f"- **Decode**: a `heron serve` per mode with the same flags (and `heron baseline llamacpp --parallel "
        f"{max(cfg.get('concurrency', [0]))} --threads {cfg.get('threads', '?')}`, llama-server with continuous "
        f"batching), measured by `heron bench serve`: {cfg.get('num_prompts', '?')} random prompts of "
        f"{cfg.get('input_len', '?')} tokens per point, {cfg.get('output_len', '?')} output tokens (ignore EOS), "
        f"concurrency {conc}, the same prompts for every engine. decode tok/s = streams x 1000 / median TPOT "
        "(streams = min(concurrency, requests): tokens per second while that many streams decode, prefill "
        "excluded); out tok/s = all output tokens over the wall time.",
    ])


def render_section(result: dict) -> str:
    """The docs/benchmarks.md section: heading, how it was measured, the tables."""
    return (f"{DOCS_HEADING}\n\n<!-- written by `python -m benchmarks.bench_quant --write-docs`; edits here are "
            f"replaced -->\n\n{_settings_text(result)}\n\n{render_table(result)}")


def write_docs(section: str, path: Path = DOCS) -> Path:
    """Put ``section`` (starting with its ``## `` heading) into ``path``: in place of the section with the same
    heading (up to the next heading of its level or above), else at the end."""
    heading = section.splitlines()[0].strip()
    level = len(heading) - len(heading.lstrip("#"))
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    start = next((i for i, line in enumerate(lines) if line.strip() == heading), None)
    new = section.rstrip("\n").splitlines()
    if start is None:
        lines = [*lines, *([""] if lines and lines[-1].strip() else []), *new]
    else:
        end = start + 1
        in_code = False
        while end < len(lines):
            line = lines[end]
            if line.startswith("```"):
                in_code = not in_code
            elif not in_code and re.match(rf"#{{1,{level}}} ", line):
                break
            end += 1
        tail = lines[end:]
        lines = [*lines[:start], *new, *([""] if tail else []), *tail]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------------------------
# measuring


def machine() -> dict:
    """heron bench's machine description plus what the figures depend on here: CPU flags, torch, threads."""
    import torch

    from heron.bench.result import machine_info
    from heron.cpu import cpu_flags

    m = machine_info()
    m.update(cpu_flags=sorted(cpu_flags()), torch=torch.__version__, torch_threads=torch.get_num_threads())
    try:
        m["heron_commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        m["heron_commit"] = None
    return m


@contextlib.contextmanager
def step_budget(llm: Any, tokens: int | None) -> Iterator[None]:
    """Run the block with the engine's per-step token budget (``--max-num-batched-tokens``) set to ``tokens``
    (None: unchanged), then restore it. The scheduler reads the budget at every step."""
    scheduler = llm.engine.core.scheduler
    saved = scheduler.max_num_batched_tokens
    if tokens is not None:
        scheduler.max_num_batched_tokens = tokens
    try:
        yield
    finally:
        scheduler.max_num_batched_tokens = saved


def step_budget_of(llm: Any) -> int:
    """The engine's per-step token budget now."""
    return llm.engine.core.scheduler.max_num_batched_tokens


def llm_perplexity(llm: Any, windows: Sequence[Window]) -> dict:
    """heron's perplexity over ``windows`` (all queued at once): prompt log probabilities of each window from
    ``SamplingParams(prompt_logprobs=0, max_tokens=1)``."""
    from heron import SamplingParams

    params = SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": w.tokens} for w in windows], params)
    return perplexity(windows, [token_logprobs(o.prompt_logprobs, w.tokens)
                                for o, w in zip(outs, windows, strict=True)])


def measure_offline(mode: Mode, args: argparse.Namespace, windows: Sequence[Window],
                    prompts: Sequence[Sequence[int]], entry: dict) -> list[list[int]] | None:
    """Load ``mode`` in this process; fill ``entry`` with weights, KV, perplexity; return the greedy outputs."""
    from heron import LLM, SamplingParams
    from heron.quantization.summary import describe_weights, weight_bytes

    errors = entry["errors"]
    greedy = None
    llm = None
    with recording(errors, "load"):
        t0 = time.perf_counter()
        llm = LLM(args.model, **mode.engine_args(), kv_cache_memory=args.kv_cache_memory,
                  max_model_len=args.max_model_len, cpu_threads=args.threads, seed=args.seed)
        entry["load_s"] = time.perf_counter() - t0
    if llm is None:
        return None
    try:
        core = llm.engine.core
        with recording(errors, "weights"):
            served = weight_bytes(core.runner.model)
            entry["weights"] = {"served_bytes": served, "served_mib": served / 2**20,
                                "description": describe_weights(core.runner.model)}
        with recording(errors, "kv"):
            blocks, size = core.block_manager.num_blocks, core.config.block_size
            entry["kv"] = {"budget": args.kv_cache_memory, "num_blocks": blocks, "block_size": size,
                           "tokens": blocks * size, "dtype": str(core.kv_dtype).removeprefix("torch."),
                           "bytes": core.runner.kv_cache_bytes}
        budgets = [("perplexity", args.ppl_step_tokens)]
        if args.ppl_step_tokens is not None:
            budgets.append(("perplexity_prefill", None))
        for key, budget in budgets:
            with recording(errors, key), step_budget(llm, budget):
                t0 = time.perf_counter()
                entry[key] = {**llm_perplexity(llm, windows), "step_tokens": step_budget_of(llm),
                              "seconds": time.perf_counter() - t0}
        with recording(errors, "greedy"), step_budget(llm, args.ppl_step_tokens):
            params = SamplingParams(temperature=0.0, max_tokens=args.agreement_tokens, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params)
            greedy = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        del llm
        gc.collect()
    return greedy


def _port_free(port: int, wait_s: float = 30.0) -> bool:
    """Whether nothing listens on 127.0.0.1:``port`` (waiting up to ``wait_s`` for a server being stopped): else
    ``wait_ready`` would find another server's /health and measure it. A connection test, not a bind: connections
    of the previous server in TIME_WAIT do not stop the next one (servers bind with SO_REUSEADDR)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        except OSError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(1)


def measure_serving(label: str, cmd: list[str], port: int, args: argparse.Namespace, out: Path) -> dict:
    """Start ``cmd`` (a server on 127.0.0.1:``port``), run ``heron bench serve`` at every concurrency into ``out``,
    stop it; the figures per concurrency (``serving_figures``). Raises with the server log's tail on failure."""
    from benchmarks import run_all
    from heron.bench.result import load_result
    from heron.model.default_model import heron_cache_dir

    if not _port_free(port):
        raise RuntimeError(f"something already listens on port {port} (another server?); pass --port")
    url = f"http://127.0.0.1:{port}"
    logs = heron_cache_dir() / "bench-logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"quant-{label}.log"
    sweep = SimpleNamespace(model=args.model, input_len=args.input_len, output_len=args.output_len,
                            num_prompts=args.num_prompts, warmup=args.warmup, seed=args.seed, goodput="",
                            concurrency=",".join(str(c) for c in args.concurrency))
    logger.info("%s: %s (log: %s)", label, " ".join(cmd), log_path)
    out.unlink(missing_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            run_all.wait_ready(url, proc, args.ready_timeout)
            run_all.bench(label, url, sweep, out)
        except (Exception, SystemExit) as e:
            raise RuntimeError(f"{e}; last lines of {log_path}:\n{_log_tail(log_path)}") from e
        finally:
            run_all.stop(proc)
    figures = serving_figures(load_result(out))
    if not any(f["completed"] for f in figures.values()):
        raise RuntimeError(f"no request completed: {[f['errors'] for f in figures.values()]}; see {log_path}")
    return figures


def heron_server_command(mode: Mode, args: argparse.Namespace, port: int) -> list[str]:
    """``heron serve`` with the mode's flags and the run's KV budget, context and threads."""
    from benchmarks import run_all

    extra = [*mode.serve_flags(), f"--kv-cache-memory={args.kv_cache_memory}",
             f"--max-model-len={args.max_model_len}", f"--cpu-threads={args.threads}", f"--seed={args.seed}"]
    return run_all.server_command("heron", args.model, port, max(args.concurrency), extra)


def run_mode(mode: Mode, args: argparse.Namespace, windows: Sequence[Window], prompts: Sequence[Sequence[int]],
             serve_out: Path) -> tuple[dict, list[list[int]] | None]:
    """Everything measured for one mode; errors recorded in the entry, never raised."""
    entry: dict[str, Any] = {"config": {**mode.engine_args(), "label": mode.label}, "errors": []}
    greedy = None
    with recording(entry["errors"], "offline"):
        greedy = measure_offline(mode, args, windows, prompts, entry)
    if args.serve and "load" not in {e["phase"] for e in entry["errors"]}:
        with recording(entry["errors"], "serving"):
            entry["serving"] = measure_serving(mode.name, heron_server_command(mode, args, args.port), args.port,
                                               args, serve_out)
            entry["serving_result"] = str(serve_out)
    return entry, greedy


def _gguf_type(gguf: Path) -> str:
    """The file's quantization from its name (e.g. "...Q4_1.gguf" -> "Q4_1")."""
    found = re.search(r"(Q\d_[A-Z0-9_]+|Q\d_\d|F16|F32|BF16)\.gguf$", gguf.name, re.IGNORECASE)
    return found.group(1).upper() if found else "GGUF"


def run_llamacpp(args: argparse.Namespace, text_file: Path, heron_tokens: Sequence[int], windows: Sequence[Window],
                 serve_out: Path) -> dict:
    """llama.cpp on the same GGUF: build (server, perplexity, tokenize), token ids, perplexity (checked to score
    heron's ``windows``), serving."""
    from benchmarks import run_all
    from heron.bench.baselines import llamacpp
    from heron.bench.resolve import resolve_model_files
    from heron.model.default_model import heron_cache_dir

    entry: dict[str, Any] = {"errors": []}
    errors = entry["errors"]
    gguf = None
    with recording(errors, "model"):
        gguf = resolve_model_files(args.model).gguf_path
        if gguf is None:
            raise RuntimeError(f"{args.model} is not a GGUF model; llama.cpp needs one")
        entry.update(gguf=str(gguf), gguf_type=_gguf_type(gguf), gguf_mib=gguf.stat().st_size / 2**20)
    built = False
    with recording(errors, "build"):
        llamacpp.build(args.jobs, targets=LLAMACPP_TARGETS)
        entry["build_dir"] = str(llamacpp.build_dir())
        built = True
    if gguf is None or not built:
        return entry
    with recording(errors, "tokenize"):
        cmd = [str(llamacpp.tool_binary("llama-tokenize")), "-m", str(gguf), "-f", str(text_file), "--ids",
               "--log-disable"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        ids_line = next((line for line in reversed(proc.stdout.splitlines()) if line.startswith("[")), None)
        if proc.returncode or ids_line is None:
            raise RuntimeError(f"llama-tokenize exited {proc.returncode}: {proc.stderr[-500:]}")
        entry["tokenization"] = compare_tokens(heron_tokens, json.loads(ids_line))
        if not entry["tokenization"]["identical"]:
            logger.warning("heron's and llama.cpp's token ids differ: %s", entry["tokenization"])
    with recording(errors, "perplexity"):
        cmd = llamacpp.perplexity_command(gguf, text_file, args.ppl_ctx, args.threads, chunks=args.ppl_chunks)
        entry["perplexity_command"] = " ".join(cmd)
        logger.info("llama.cpp: %s", entry["perplexity_command"])
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        output = proc.stdout + proc.stderr
        log_path = heron_cache_dir() / "bench-logs" / "quant-llama-perplexity.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(output)
        entry["perplexity_log"] = str(log_path)
        if proc.returncode:
            raise RuntimeError(f"llama-perplexity exited {proc.returncode}: {output[-800:]}")
        entry["perplexity"] = {**parse_llamacpp_perplexity(output), "seconds": time.perf_counter() - t0}
        scored = entry["perplexity"].get("tokens_scored")
        entry["perplexity"]["same_windows_as_heron"] = (entry["perplexity"].get("windows") == len(windows)
                                                        and scored == sum(w.num_scored for w in windows))
        if not entry["perplexity"]["same_windows_as_heron"]:
            logger.warning("llama-perplexity scored %s chunks (%s tokens), heron %d windows: not comparable",
                           entry["perplexity"].get("windows"), scored, len(windows))
    if args.serve:
        with recording(errors, "serving"):
            port = args.port + 1
            cmd = run_all.server_command("llamacpp", args.model, port, max(args.concurrency), [])
            cmd += ["--threads", str(args.threads)]
            entry["server_command"] = " ".join(cmd)
            entry["serving"] = measure_serving("llamacpp", cmd, port, args, serve_out)
            entry["serving_result"] = str(serve_out)
    return entry


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("values must be integers >= 1")
    return sorted(set(values))


def _mode_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in MODES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {', '.join(unknown) or '(none)'}; choose from "
                                         f"{', '.join(MODES)}")
    return names


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", type=_mode_list, default=list(MODES),
                    help=f"comma-separated modes, in order (default: {','.join(MODES)})")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a GGUF model (default: smollm2-135m-instruct)")
    ap.add_argument("--kv-cache-memory", default="512MiB", help="KV budget of every mode (default: 512MiB)")
    ap.add_argument("--max-model-len", type=int, default=2048, help="context length of every mode (default: 2048)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for heron (--cpu-threads) and llama.cpp "
                    "(-t) alike (default: heron's serving default for this machine)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the engines and the random prompts (default: 0)")
    g = ap.add_argument_group("quality")
    g.add_argument("--text", type=Path, default=TEXT, help="text to score (default: benchmarks/data/quality_text.txt)")
    g.add_argument("--ppl-ctx", type=int, default=512, help="perplexity chunk length, llama-perplexity's -c: the "
                   "second half of each chunk is scored (default: 512)")
    g.add_argument("--ppl-chunks", type=int, default=None, help="score only the first N chunks, for heron and "
                   "llama-perplexity (--chunks) alike (default: all; for quick checks)")
    g.add_argument("--ppl-step-tokens", type=int, default=None,
                   help="per-step token budget for the perplexity and the greedy outputs (default: the engine's; "
                   "given, the default budget's perplexity is also taken, as perplexity_prefill)")
    g.add_argument("--agreement-prompts", type=int, default=32, help="greedy prompts taken from the text (default: 32)")
    g.add_argument("--agreement-prompt-len", type=int, default=64, help="tokens per greedy prompt (default: 64)")
    g.add_argument("--agreement-tokens", type=int, default=64, help="greedy tokens per prompt (default: 64)")
    g = ap.add_argument_group("decode speed")
    g.add_argument("--serve", action=argparse.BooleanOptionalAction, default=True,
                   help="measure decode through a server per mode (default: on)")
    g.add_argument("--concurrency", type=_int_list, default=[1, 32], help="concurrency points (default: 1,32)")
    g.add_argument("--num-prompts", type=int, default=32, help="requests per concurrency point (default: 32)")
    g.add_argument("--warmup", type=int, default=2, help="unrecorded requests per server first (default: 2)")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens (random, unique) (default: 128)")
    g.add_argument("--output-len", type=int, default=64, help="output tokens (default: 64)")
    g.add_argument("--port", type=int, default=8010, help="heron's port; llama-server takes the next (default: 8010)")
    g.add_argument("--ready-timeout", type=float, default=900, help="seconds a server may take to load (default: 900)")
    g = ap.add_argument_group("llama.cpp")
    g.add_argument("--llamacpp", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure llama.cpp on the same GGUF (default: on)")
    g.add_argument("--jobs", type=int, default=None, help="compile jobs if llama.cpp must be built (default: all cores)")
    g = ap.add_argument_group("output")
    g.add_argument("--out-dir", type=Path, default=None, help="default: benchmarks/results/quant-<YYYY-MM-DD>")
    g.add_argument("--write-docs", action="store_true", help=f"write the tables into docs/benchmarks.md under "
                   f"'{DOCS_HEADING}' (replacing that section)")
    g.add_argument("--docs", type=Path, default=DOCS, help="the docs file --write-docs writes (default: "
                   "docs/benchmarks.md)")
    g.add_argument("--from-result", type=Path, default=None, help="measure nothing: print (and with --write-docs, "
                   "write) the tables of this result file")
    args = ap.parse_args(argv)
    if args.ppl_ctx < 4 or args.agreement_prompts < 1 or args.num_prompts < 1:
        ap.error("--ppl-ctx must be >= 4, --agreement-prompts and --num-prompts >= 1")
    return args


def save(result: dict, path: Path) -> None:
    """Write the result file (after every mode, so an interrupted run keeps what it measured)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> dict:
    """Measure every mode (and llama.cpp); returns the result, also written to its JSON file (``argv``: the
    command line, recorded)."""
    from heron.bench.result import machine_info
    from heron.cpu import engine_threads
    from heron.model.loader import load_tokenizer_only

    args.threads = args.threads or engine_threads(None, serving=True)
    now = dt.datetime.now(dt.timezone.utc)
    out_dir = args.out_dir or RESULTS / f"quant-{now:%Y-%m-%d}"
    stamp = f"{now:%H%M%S}"
    path = out_dir / f"quant_{stamp}.json"
    text = load_text(args.text)
    tokenizer = load_tokenizer_only(args.model)
    add_bos = bool(getattr(tokenizer, "add_bos_token", False)) and tokenizer.bos_token_id is not None
    tokens = tokenizer.encode(text, add_special_tokens=False)
    tokens = [tokenizer.bos_token_id, *tokens] if add_bos else tokens
    windows = perplexity_windows(tokens, args.ppl_ctx, tokenizer.bos_token_id if add_bos else None, args.ppl_chunks)
    prompts = agreement_prompts(tokens, args.agreement_prompts, args.agreement_prompt_len)
    body = out_dir / "quality_text.body.txt"  # exactly what both engines tokenize (no header, no final newline)
    out_dir.mkdir(parents=True, exist_ok=True)
    body.write_text(text, encoding="utf-8")
    command = shlex.join(["python", "-m", "benchmarks.bench_quant", *argv])
    result: dict[str, Any] = {
        "format": FORMAT, "date": now.replace(microsecond=0).isoformat(), "machine": machine(),
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                      if k not in ("from_result", "write_docs", "docs")},
                   "command": command, "result_file": str(path.relative_to(ROOT) if path.is_relative_to(ROOT)
                                                          else path),
                   "text_tokens": len(tokens), "add_bos": add_bos, "ppl_windows": len(windows),
                   "ppl_tokens_scored": sum(w.num_scored for w in windows),
                   "perplexity_method": (
                       "llama-perplexity's windows, for heron and llama.cpp alike: the text's tokens cut into "
                       f"{len(windows)} consecutive chunks of {args.ppl_ctx} (remainder dropped), each evaluated "
                       f"from an empty cache; scored: positions {args.ppl_ctx // 2 + 1}..{args.ppl_ctx - 1} of each "
                       "chunk, predicted from all tokens before them in the chunk; heron's log probabilities from "
                       "SamplingParams(prompt_logprobs=0, max_tokens=1) through LLM, at a step budget of "
                       f"{args.ppl_step_tokens or 'the engine default'} tokens"),
                   "decode_definition": ("decode_tok_s = min(concurrency, completed) x 1000 / median TPOT; "
                                         "output_tok_s = output tokens / wall time of the run"),
                   "note": NO_CHECKPOINT_NOTE},
        "modes": {}, "llamacpp": None}
    greedy: dict[str, list[list[int]]] = {}
    todo = [*args.modes, *([LLAMACPP] if args.llamacpp else [])]
    with logging_redirect_tqdm():
        for name in tqdm(todo, desc="modes", unit="mode"):
            logger.info("== %s", name)
            if name == LLAMACPP:
                try:
                    result["llamacpp"] = run_llamacpp(args, body, tokens, windows,
                                                     out_dir / f"serve_llamacpp_{stamp}.json")
                except Exception as e:  # run_llamacpp records its own phases; this is a last resort
                    result["llamacpp"] = {"errors": [{"phase": "llamacpp", "error": f"{type(e).__name__}: {e}",
                                                      "traceback": traceback.format_exc(limit=-6)}]}
            else:
                try:
                    entry, outputs = run_mode(MODES[name], args, windows, prompts,
                                              out_dir / f"serve_{name}_{stamp}.json")
                except Exception as e:  # run_mode records its own phases; this is a last resort
                    entry, outputs = {"errors": [{"phase": "mode", "error": f"{type(e).__name__}: {e}",
                                                  "traceback": traceback.format_exc(limit=-6)}]}, None
                result["modes"][name] = entry
                if outputs is not None:
                    greedy[name] = outputs
            save(result, path)
    for name, entry in result["modes"].items():
        if REFERENCE in greedy and name in greedy:
            entry["agreement"] = greedy_agreement(greedy[REFERENCE], greedy[name])
        elif name in greedy:
            entry["agreement"] = None
            entry["agreement_note"] = f"no {REFERENCE} outputs to compare with (not run, or it failed)"
    result["load_average_end"] = machine_info()["load_average"]
    result["targets"] = evaluate_targets(result)
    save(result, path)
    logger.info("wrote %s", path)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or re-render a result), print the tables, optionally write the docs section."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    if args.from_result:
        result = json.loads(args.from_result.read_text())
        result["targets"] = evaluate_targets(result)
    else:
        result = run(args, sys.argv[1:] if argv is None else argv)
    print(render_table(result))
    if args.write_docs:
        logger.info("wrote the %r section of %s", DOCS_HEADING, write_docs(render_section(result), args.docs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
