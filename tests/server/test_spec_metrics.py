"""Speculative-decoding counters on /metrics: vLLM v1's names with the ``heron:`` prefix and ``model_name``."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from heron.engine.outputs import EngineStats
from heron.server.metrics import ServerMetrics

SPEC_COUNTERS = ("heron:spec_decode_num_drafts", "heron:spec_decode_num_draft_tokens",
                 "heron:spec_decode_num_accepted_tokens")
PER_POS = "heron:spec_decode_num_accepted_tokens_per_pos"


def _families(stats: EngineStats) -> tuple[dict, str]:
    text = ServerMetrics("tiny", lambda: stats).render().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}, text


def _totals(family) -> list[tuple[dict, float]]:
    return [(s.labels, s.value) for s in family.samples if s.name.endswith("_total")]


def test_spec_decode_counters_are_exported_with_vllm_names():
    stats = EngineStats(num_drafts=10, num_draft_tokens=30, num_accepted_tokens=17, accepted_per_position=[8, 6, 3])
    families, text = _families(stats)
    for name, value in zip(SPEC_COUNTERS, (10, 30, 17), strict=True):
        assert families[name].type == "counter"
        assert _totals(families[name]) == [({"model_name": "tiny"}, value)]
        assert f'{name}_total{{model_name="tiny"}} {float(value)}' in text  # the exposition's sample name
    per_pos = families[PER_POS]
    assert per_pos.type == "counter"
    assert _totals(per_pos) == [({"model_name": "tiny", "position": str(i)}, v) for i, v in enumerate((8, 6, 3))]
    assert f'{PER_POS}_total{{model_name="tiny",position="1"}} 6.0' in text


def test_without_speculation_the_counters_exist_at_zero():
    families, text = _families(EngineStats())
    for name in SPEC_COUNTERS:
        assert _totals(families[name]) == [({"model_name": "tiny"}, 0.0)]
        assert f"# TYPE {name}_total counter" in text
    assert _totals(families[PER_POS]) == []  # no draft positions, no samples


def test_counters_follow_the_engine_stats_at_each_scrape():
    stats = EngineStats()
    metrics = ServerMetrics("tiny", lambda: stats)
    stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens = 2, 6, 5
    stats.accepted_per_position = [2, 2, 1]
    text = metrics.render().decode()
    assert 'heron:spec_decode_num_accepted_tokens_total{model_name="tiny"} 5.0' in text
    assert 'heron:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="2"} 1.0' in text
