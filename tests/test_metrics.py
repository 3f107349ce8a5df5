"""The speculative-decoding counters alone: counted once (SpecDecodingStats),
exported at scrape time and logged per interval from the same numbers."""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specd.metrics import RouterPrometheus, SpecDecodingLogging, SpecDecodingStats


def _samples(registry: CollectorRegistry) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, s.labels.get("position"))] = s.value
    return out


def test_stats_count_drafts_and_acceptance_by_position():
    s = SpecDecodingStats()
    for drafted, accepted in [(4, 4), (2, 1), (0, 0), (3, 0)]:
        s.observe_draft(drafted, accepted)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 9, 5)
    assert s.num_drafts_per_pos == [3, 3, 2, 1]
    assert s.num_accepted_tokens_per_pos == [2, 1, 1, 1]


def test_an_interval_is_what_was_counted_since_its_mark():
    s = SpecDecodingStats()
    s.observe_draft(4, 2)
    mark = s.copy()
    s.observe_draft(2, 2)
    since = s.minus(mark)
    assert (since.num_drafts, since.num_draft_tokens, since.num_accepted_tokens) == (1, 2, 2)
    assert since.num_drafts_per_pos == [1, 1] and since.num_accepted_tokens_per_pos == [1, 1]


def test_prometheus_and_the_log_read_the_same_counts(caplog):
    m = RouterPrometheus()
    for drafted, accepted in [(4, 3), (4, 0), (1, 1)]:
        m.spec_decode.observe(drafted, accepted)
    got = _samples(m.registry)
    assert got[("specd_spec_decode_num_drafts_total", None)] == 3
    assert got[("specd_spec_decode_num_draft_tokens_total", None)] == 9
    assert got[("specd_spec_decode_num_accepted_tokens_total", None)] == 4
    assert [got[("specd_spec_decode_num_accepted_tokens_per_pos_total", str(i))] for i in range(4)] == [2, 1, 1, 0]
    assert [got[("specd_spec_decode_num_draft_tokens_per_pos_total", str(i))] for i in range(4)] == [3, 2, 2, 2]
    with caplog.at_level(logging.INFO, logger="specd.metrics"):
        SpecDecodingLogging(SpecDecodingStats()).log()  # nothing counted: no line
        assert not caplog.records
        log = SpecDecodingLogging(m.spec)
        m.spec_decode.observe(2, 2)
        log.log()
    (line,) = [r.getMessage() for r in caplog.records]
    assert "drafts 1, draft tokens 2, accepted 2" in line and "[1.00, 1.00]" in line
