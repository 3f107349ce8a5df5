"""`specd bench` end to end on a tiny setting: all three modes run, greedy
outputs agree, and the JSON, markdown and plot are written."""
import json
import subprocess
import sys

import pytest


def test_bench_smoke(tmp_path, models):
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "specd", "bench", "--drafts", "q4_1,ngram:simple", "--draft-lengths", "2",
         "--prompts", "2", "--max-tokens", "12", "--repeats", "1", "--n-ctx", "512", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "bench.json").read_text())
    modes = {(r["mode"], r["draft"]) for r in result["rows"]}
    assert modes == {("target-only", "-"), ("distributed", "q4_1"), ("in-process", "q4_1"),
                     ("distributed", "ngram:simple"), ("in-process", "ngram:simple")}
    assert result["greedy_output_mismatches"] == []
    for r in result["rows"]:
        assert r["tok_s_median"] > 0
        if r["mode"] == "distributed":
            assert r["distributed_over_in_process"] > 0
            assert r["overhead_ms_per_step_median"] >= 0
    assert "| distributed | q4_1 | 2 |" in (out / "bench.md").read_text()
    assert (out / "bench.png").stat().st_size > 1000


def test_bench_load_smoke(tmp_path, models):
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "specd", "bench", "--concurrency", "1,2", "--drafts", "q4_1", "--draft-lengths", "3",
         "--max-tokens", "10", "--requests-per-session", "1", "--min-requests", "2", "--repeats", "1",
         "--n-ctx", "512", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "bench-load.json").read_text())
    cells = {(r["concurrency"], r["mode"]) for r in result["rows"]}
    assert cells == {(c, m) for c in (1, 2) for m in ("target-only", "fixed", "adaptive")}
    assert result["greedy_output_mismatches"] == []
    fixed = next(r for r in result["rows"] if r["mode"] == "fixed" and r["concurrency"] == 1)
    assert fixed["acceptance"] is not None and fixed["tok_s_median"] > 0
    base = next(r for r in result["rows"] if r["mode"] == "target-only" and r["concurrency"] == 2)
    assert base["vs_target_only_paired"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    assert "| 2 | adaptive |" in (out / "bench-load.md").read_text()


def test_paired_ratios_cancel_drift_between_repetitions():
    from specd.bench_load import paired_ratios

    # the machine ran 20% faster in the second repetition: both modes moved
    # together, and each repetition says the mode is 5% faster
    assert paired_ratios([105.0, 126.0], [100.0, 120.0]) == pytest.approx([1.05, 1.05])
    assert paired_ratios([1.0], [0.0]) == []


def test_drafts_list_keeps_ngram_chains_and_parameters():
    from specd.bench import resolve_draft, split_drafts

    drafts = split_drafts("q4_1, ngram:map-k:size-n=3:size-m=16,cache ,q2_k,ngram:mod")
    assert drafts == ["q4_1", "ngram:map-k:size-n=3:size-m=16,cache", "q2_k", "ngram:mod"]
    assert resolve_draft(drafts[1]) == ("", "map-k:size-n=3:size-m=16,cache")
