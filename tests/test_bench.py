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
    assert base["vs_target_only_paired"] == {"median": 1.0, "min": 1.0, "max": 1.0, "geomean": 1.0, "ci90": [1.0, 1.0]}
    # the target's own counters: target-only decodes about once per token
    # (one more for the prompt), drafting verifies several tokens per decode
    alone = next(r for r in result["rows"] if r["mode"] == "target-only" and r["concurrency"] == 1)
    assert 0.9 <= alone["target_decodes_per_token"] <= 1.5, alone
    assert fixed["target_decodes_per_token"] < 0.8 * alone["target_decodes_per_token"], fixed
    assert alone["target_sequences_per_decode"] == 1.0 and base["target_sequences_per_decode"] > 1.0
    assert all(r["target_ms_per_decode"] > 0 and 0 < r["target_busy_share"] <= 1 for r in result["rows"])
    assert "| 2 | adaptive |" in (out / "bench-load.md").read_text()


def test_paired_ratios_cancel_drift_between_repetitions():
    from specd.bench_common import paired_ratios

    # the machine ran 20% faster in the second repetition: both modes moved
    # together, and each repetition says the mode is 5% faster
    assert paired_ratios([105.0, 126.0], [100.0, 120.0]) == pytest.approx([1.05, 1.05])
    assert paired_ratios([1.0], [0.0]) == []


def test_mode_orders_balance_place_and_predecessor():
    import collections

    from specd.bench_common import balanced_order
    from specd.bench_load import MODES

    orders = [balanced_order(list(MODES), rep) for rep in range(6)]
    assert all(sorted(o) == sorted(MODES) for o in orders)
    places = collections.Counter((m, o.index(m)) for o in orders for m in o)
    assert set(places.values()) == {2}  # each mode twice in each place
    after = collections.Counter(pair for o in orders for pair in zip(o, o[1:]))
    assert set(after.values()) == {2} and len(after) == 6  # each mode twice right after each other
    assert balanced_order(list(MODES), 6) == orders[0]
    assert balanced_order(["target-only", "adaptive"], 1) == ["adaptive", "target-only"]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 12])
def test_balanced_orders_put_each_contender_in_each_place_and_after_each_other(n):
    # the llama-server bench's contenders: a rotation would put specd's
    # plain path always right after specd
    import collections

    from specd.bench_common import balanced_order

    items = [f"c{i}" for i in range(n)]
    reps = n if n % 2 == 0 else 2 * n
    orders = [balanced_order(items, rep) for rep in range(reps)]
    assert all(sorted(o) == sorted(items) for o in orders)
    places = collections.Counter((x, o.index(x)) for o in orders for x in o)
    assert set(places.values()) == {reps // n} and len(places) == n * n
    after = collections.Counter(pair for o in orders for pair in zip(o, o[1:]))
    assert len(after) == n * (n - 1) and len(set(after.values())) <= 1  # each after each other, equally often
    assert balanced_order(items, reps) == orders[0]


def test_bench_modes_flag_names_a_bad_mode():
    proc = subprocess.run([sys.executable, "-m", "specd", "bench", "--concurrency", "1", "--modes", "adaptive,turbo"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--modes" in proc.stderr and "turbo" in proc.stderr, proc.stderr


def test_geomean_interval_averages_ratios_as_logarithms():
    from specd.bench_common import geomean_interval

    mean, lo, hi = geomean_interval([0.8, 1.25])
    assert mean == pytest.approx(1.0) and lo == pytest.approx(0.8) and hi == pytest.approx(1.25)
    assert geomean_interval([1.1] * 5) == pytest.approx((1.1, 1.1, 1.1))
    noisy = [0.85, 1.12, 0.95, 1.07, 1.01, 0.92, 1.10, 0.98, 1.04]
    mean, lo, hi = geomean_interval(noisy)
    assert lo < mean < hi and hi - lo < max(noisy) - min(noisy)  # the mean is known better than one ratio
    wide = geomean_interval(noisy[:3])
    assert wide[2] - wide[1] > hi - lo  # fewer repetitions, wider interval
    assert geomean_interval(noisy) == (mean, lo, hi)  # deterministic


def test_drafts_list_keeps_ngram_chains_and_parameters():
    from specd.bench_common import split_drafts
    from specd.models import resolve_draft

    drafts = split_drafts("q4_1, ngram:map-k:size-n=3:size-m=16,cache ,q2_k,ngram:mod")
    assert drafts == ["q4_1", "ngram:map-k:size-n=3:size-m=16,cache", "q2_k", "ngram:mod"]
    assert resolve_draft(drafts[1]) == ("", "map-k:size-n=3:size-m=16,cache")


def test_first_difference_names_the_request_and_the_token():
    from specd.bench_common import first_difference

    assert first_difference([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]) == (1, 1)
    assert first_difference([[1, 2, 3]], [[1, 2]]) == (0, 2)  # ended early
    assert first_difference([[1], [2]], [[1]]) == (1, 0)  # a request missing


def test_pooled_under_load_takes_every_load_above_the_first_and_narrows_the_interval():
    from specd.bench_common import geomean_interval
    from specd.bench_load import pooled_under_load

    tok_s = {(1, "target-only"): [40.0, 40.0], (1, "adaptive"): [60.0, 60.0],  # one session: not pooled
             (2, "target-only"): [70.0, 80.0], (2, "adaptive"): [77.0, 72.0],
             (4, "target-only"): [100.0, 120.0], (4, "adaptive"): [95.0, 126.0]}
    p = pooled_under_load(tok_s, [1, 2, 4], "adaptive")
    ratios = [1.1, 0.9, 0.95, 1.05]
    assert p["pairs"] == 4
    assert p["geomean"] == pytest.approx(geomean_interval(ratios)[0])
    assert p["ci90"] == pytest.approx(list(geomean_interval(ratios)[1:]))
    one_load = geomean_interval(ratios[:2])
    assert p["ci90"][1] - p["ci90"][0] < one_load[2] - one_load[1]
    assert pooled_under_load(tok_s, [1, 2, 4], "fixed")["pairs"] == 0  # a mode that did not run


def test_bench_modes_flag_takes_the_noise_floor_mode():
    from specd.bench import _modes

    assert _modes("adaptive,target-only-again") == ("target-only", "adaptive", "target-only-again")
    assert _modes("fixed") == ("target-only", "fixed")


def test_temperatures_argument_and_modes():
    import argparse

    from specd.bench import add_parser
    from specd.bench_temperature import modes

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--temperatures", "0,0.7,1.0"])
    assert args.temperatures == (0.0, 0.7, 1.0)
    assert parser.parse_args(["bench"]).temperatures == ()
    for bad in ("-1", "warm", ","):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", "--temperatures", bad])
    # greedy has one acceptance rule; sampled temperatures compare both
    assert {a for a, _ in modes(0.0)} == {"exact"}
    assert modes(0.7) == [("exact", "fixed"), ("exact", "adaptive"), ("rejection", "fixed"), ("rejection", "adaptive")]


def test_bench_fresh_starts_flag_makes_a_cluster_per_repetition_and_counts_the_starts_that_drafted(monkeypatch):
    import specd.launcher
    from specd.bench_common import clusters, fresh_start_lines, fresh_start_summary
    from specd.cli import parser
    from specd.launcher import ClusterSpec

    assert parser().parse_args(["bench", "--fresh-starts", "--repeats", "3"]).fresh_starts is True
    assert parser().parse_args(["bench", "--concurrency", "1,2"]).fresh_starts is False

    started = []

    class Recording:  # what would be started: no processes in this test
        def __init__(self, spec):
            started.append(spec)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(specd.launcher, "Cluster", Recording)
    spec = ClusterSpec(target_model="t.gguf", draft_model="d.gguf")
    assert [rep for rep, _ in clusters(spec, 3, fresh=False)] == [0, 1, 2] and len(started) == 1
    assert not started[0].start_together
    started.clear()
    assert [rep for rep, _ in clusters(spec, 3, fresh=True)] == [0, 1, 2]
    assert len(started) == 3 and all(s.start_together for s in started)  # workers started at the same moment

    summary = fresh_start_summary([120, 0, 57])
    assert summary == {"starts": 3, "drafted": 2, "share": 2 / 3, "drafted_tokens": [120, 0, 57]}
    assert fresh_start_lines({"adaptive": summary}) == [
        "Fresh starts (adaptive): adaptive speculation drafted in 2 of 3 (tokens drafted per start: 120, 0, 57)."]


def test_llama_server_comparison_tells_lossless_differences_from_engine_ones():
    """Speculative contenders are checked against their own engine without
    speculation; specd's plain path against llama-server is reported apart."""
    from specd.bench_server import compare_outputs

    a, b = [[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]
    out = compare_outputs({"llama-server": a, "llama-server-draft": b, "specd": a, "specd-no-spec": a})
    assert out == [{"kind": "same engine", "contender": "llama-server-draft", "against": "llama-server",
                    "request": 1, "position": 1, "expected": [5, 6], "got": [9, 6]}]
    out = compare_outputs({"llama-server": a, "specd": b, "specd-no-spec": b})
    assert [(d["kind"], d["contender"], d["against"]) for d in out] == [("across engines", "specd-no-spec", "llama-server")]
    out = compare_outputs({"llama-server": a, "llama-server ngram-mod:n-max=8": a, "specd ngram-mod:n-max=8": b})
    assert [(d["kind"], d["contender"], d["against"]) for d in out] == [
        ("across engines", "specd ngram-mod:n-max=8", "llama-server")]  # --ngram runs have no plain specd contender


def test_llama_server_ngram_flags_and_draft_bound_follow_llama_cpp():
    """Both sides draft at most what llama-server's common_speculative_n_max
    allows the type: its size-m / n-max parameter, or that one's default."""
    from specd.bench_server import ngram_server_args

    assert ngram_server_args("mod:n-match=4:n-min=0:n-max=16") == (
        ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "4", "--spec-ngram-mod-n-min", "0",
         "--spec-ngram-mod-n-max", "16"], 16)
    assert ngram_server_args("simple")[1] == 48 and ngram_server_args("map-k:size-m=20")[1] == 20
    assert ngram_server_args("mod")[1] == 64 and ngram_server_args("cache")[1] == 8
    with pytest.raises(SystemExit, match="unknown type"):
        ngram_server_args("lookup")


def test_a_greedy_difference_names_its_request_and_token():
    from specd.bench_common import Run
    from specd.bench_single import _differences, markdown

    def runs(*outputs):
        return [Run(len(t), 0, 0, 1, 1.0, 0.0, 0.0, 1.0, 0.0, list(t)) for t in outputs]

    baseline = [[1, 2, 3], [4, 5, 6, 7]]
    assert _differences("distributed", "q4_1", 4, 0, runs([1, 2, 3], [4, 5, 6, 7]), baseline) == []
    (found,) = _differences("in-process", "q4_1", 4, 2, runs([1, 2, 3], [4, 5, 9, 7]), baseline)
    assert (found["mode"], found["repetition"], found["request"], found["position"]) == ("in-process", 2, 1, 2)
    assert (found["expected"], found["got"]) == ([6, 7], [9, 7])
    # a shorter answer differs where it stops
    (short,) = _differences("distributed", "q4_1", 4, 0, runs([1, 2], [4, 5, 6, 7]), baseline)
    assert (short["request"], short["position"], short["got"]) == (0, 2, [])
    result = {"settings": {"target_model": "t.gguf", "target_threads": 1, "draft_threads": 1, "drafts": ["q4_1"],
                           "workload": "prompts", "prompts": 2, "max_tokens": 4, "repeats": 3},
              "machine": {"cpus": 2, "processor": "x86_64", "platform": "x"}, "rows": [], "greedy_output_mismatches": [found]}
    assert "in-process q4_1 n=4, repetition 2: request 1, token 2 (expected [6, 7], got [9, 7])" in markdown(result)
