"""`specd bench --concurrency 1,2,4,8,16`: aggregate throughput under load.

One cluster (target, draft, router as processes, each worker hosting as many
sequences as the highest concurrency), or with --fresh-starts a new one each
repetition, both workers started at once: the share of starts whose
adaptive cells drafted is reported. For each concurrency C, C client
sessions run at once, each sending its share of the same request list one
after the other; for each mode the same requests:

- target-only: speculation off;
- fixed: draft length n_draft every step (adaptive off);
- adaptive: the router picks each step's draft length, n_draft the bound;
- target-only-again (only when asked): a second target-only cell, compared
  with the first like any mode: the spread of that ratio is the noise floor
  of the run, what a mode identical to target-only would show.

Aggregate tokens/s = generated tokens / wall time of the whole cell; the
repetitions go through every order of the modes in turn. The
prompt cache is off so every mode processes every prompt. Greedy output of
each request must be identical across modes.

A mode is compared with target-only per repetition (the two cells ran
back to back) and over repetitions by the geometric mean of those ratios
with a bootstrap 90% interval. Next to it, what the target's own counters
say of each cell: llama_decode calls per generated token (the schedule a
mode made) and milliseconds per call (how fast the machine ran them). On
a small shared VM the second moves a lot between cells of the same
batches, which is what the ratios' spread is made of (docs/perf/README.md).
"""
from __future__ import annotations

import os
import platform
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from specd.bench_common import (balanced_order, clusters, difference, draft_length, fresh_start_lines,
                                fresh_start_summary, geomean_interval, load_prompts, paired_ratios, progress,
                                split_drafts)
from specd.models import resolve_draft, resolve_target

MODES = ("target-only", "fixed", "adaptive")  # the default
NULL_MODE = "target-only-again"
KNOWN_MODES = (*MODES, NULL_MODE)


def _mode_kwargs(mode: str, n_draft: int) -> dict:
    if mode in ("target-only", NULL_MODE):
        return {"speculative": False}
    return {"speculative": True, "n_draft": n_draft, "adaptive": mode == "adaptive"}


def run_cell(address: str, prompts: list[str], concurrency: int, max_tokens: int, kwargs: dict) -> dict:
    from specd.client import RouterClient  # loads gRPC: not at CLI start

    shares = [prompts[i::concurrency] for i in range(concurrency)]
    with RouterClient(address, timeout=1800) as client:
        def session(share):
            return [client.generate(p, max_tokens=max_tokens, **kwargs) for p in share]

        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            done = list(pool.map(session, shares))
        wall = time.perf_counter() - t0
    by_prompt = {}
    for share, outs in zip(shares, done):
        for p, c in zip(share, outs):
            by_prompt[p] = c
    outs = [by_prompt[p] for p in prompts]
    gen = sum(c.n_generated for c in outs)
    drafted = sum(c.n_drafted for c in outs)
    return {"tok_s": gen / wall, "wall": wall, "generated": gen, "drafted": drafted,
            "accepted": sum(c.n_accepted for c in outs), "tokens": [c.tokens for c in outs]}


def target_counters(ports: list[int], host: str = "127.0.0.1") -> dict[str, float]:
    """The target workers' llama_decode counters, summed: calls, sequences
    over all calls, seconds spent in them."""
    from prometheus_client.parser import text_string_to_metric_families  # ~45 ms to import: not at CLI start

    want = {"specd_worker_decode_latency_seconds_count": "decodes",
            "specd_worker_decode_latency_seconds_sum": "busy",
            "specd_worker_decode_batch_sequences_sum": "sequences"}
    out = dict.fromkeys(want.values(), 0.0)
    for port in ports:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in want:
                    out[want[sample.name]] += sample.value
    return out


def bench_load(args) -> dict:
    from specd.launcher import ClusterSpec  # loads gRPC: not at CLI start

    levels = [int(x) for x in args.concurrency.split(",")]
    modes = tuple(getattr(args, "modes", MODES))
    draft = split_drafts(args.drafts)[0]
    n_draft = draft_length(args)
    target_model = resolve_target(args.target)
    draft_model, ngram = resolve_draft(draft)
    base_prompts = load_prompts(args.workload, 0)
    spec = ClusterSpec(target_model=target_model, draft_model=draft_model, ngram=ngram,
                       target_threads=args.target_threads, target_threads_batch=args.target_threads_batch,
                       draft_threads=args.draft_threads,
                       n_ctx=args.n_ctx, n_seq=max(levels), router_args=["--no-prompt-cache"], metrics=True)
    cells: dict[tuple[int, str], list[dict]] = {}
    mismatches = []
    fresh = getattr(args, "fresh_starts", False)
    starts: list[int] = []  # per fresh start: tokens its adaptive cells drafted
    bar = progress(total=len(levels) * len(modes) * args.repeats, desc="specd bench (load)", unit="cell")
    for rep, cluster in clusters(spec, args.repeats, fresh):
        targets = [port for name, port in cluster.metrics_ports.items() if name.startswith("target")]
        starts.append(0)
        for c in levels:
            n_req = max(args.requests_per_session * c, args.min_requests)
            prompts = [base_prompts[i % len(base_prompts)] for i in range(n_req)]
            ref = ref_mode = None
            for mode in balanced_order(list(modes), rep):
                before = target_counters(targets, spec.host)
                cell = run_cell(cluster.router_address, prompts, c, args.max_tokens, _mode_kwargs(mode, n_draft))
                after = target_counters(targets, spec.host)
                cell["target"] = {k: after[k] - before[k] for k in after}
                cells.setdefault((c, mode), []).append(cell)
                starts[-1] += cell["drafted"] if mode == "adaptive" else 0
                if ref is None:
                    ref, ref_mode = cell["tokens"], mode
                elif cell["tokens"] != ref:
                    mismatches.append({"repetition": rep, "sessions": c, "mode": mode, "against": ref_mode,
                                       **difference(ref, cell["tokens"])})
                bar.update(1)
                bar.set_postfix_str(f"C={c} {mode}: {cell['tok_s']:.1f} tok/s")
    bar.close()
    rows = []
    for (c, mode), runs in cells.items():
        drafted = sum(r["drafted"] for r in runs)
        rows.append({
            "concurrency": c, "mode": mode, "tok_s_median": statistics.median(r["tok_s"] for r in runs),
            "tok_s_min": min(r["tok_s"] for r in runs), "tok_s_max": max(r["tok_s"] for r in runs),
            "acceptance": sum(r["accepted"] for r in runs) / drafted if drafted else None,
            "drafted_per_token": drafted / max(sum(r["generated"] for r in runs), 1),
            "tok_s_runs": [r["tok_s"] for r in runs],
            **target_figures(runs),
        })
    tok_s = {key: [x["tok_s"] for x in runs] for key, runs in cells.items()}
    for r in rows:
        base = next(x for x in rows if x["concurrency"] == r["concurrency"] and x["mode"] == "target-only")
        one = next(x for x in rows if x["concurrency"] == levels[0] and x["mode"] == r["mode"])
        r["vs_target_only"] = r["tok_s_median"] / base["tok_s_median"]
        r["vs_one_session"] = r["tok_s_median"] / one["tok_s_median"]
        paired = paired_ratios(tok_s[(r["concurrency"], r["mode"])], tok_s[(r["concurrency"], "target-only")])
        mean, lo, hi = geomean_interval(paired)
        r["vs_target_only_paired"] = {"median": statistics.median(paired), "min": min(paired), "max": max(paired),
                                      "geomean": mean, "ci90": [lo, hi]}
    return {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {"target": args.target, "target_model": target_model, "draft": draft, "n_draft": n_draft,
                     "concurrency": levels, "modes": list(modes), "workload": args.workload, "max_tokens": args.max_tokens,
                     "requests_per_session": args.requests_per_session, "min_requests": args.min_requests,
                     "repeats": args.repeats, "target_threads": args.target_threads,
                     "target_threads_batch": args.target_threads_batch,
                     "draft_threads": args.draft_threads, "greedy": True, "prompt_cache": False,
                     "fresh_starts": fresh},
        "greedy_output_mismatches": mismatches,
        "fresh_starts": {"adaptive": fresh_start_summary(starts)} if fresh and "adaptive" in modes else {},
        "rows": sorted(rows, key=lambda r: (r["concurrency"], KNOWN_MODES.index(r["mode"]))),
        "pooled_under_load": {m: pooled_under_load(tok_s, levels, m) for m in modes if m != "target-only"},
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def pooled_under_load(tok_s: dict[tuple[int, str], list[float]], levels: list[int], mode: str) -> dict:
    """A mode's paired ratios to target-only at every load above the first,
    pooled: {"pairs", "geomean", "ci90"}. Where a mode does what
    target-only does (adaptive once drafting cannot pay), one load's few
    repetitions say little; all of them together narrow the interval."""
    ratios = [r for c in levels[1:] if (c, mode) in tok_s
              for r in paired_ratios(tok_s[(c, mode)], tok_s[(c, "target-only")])]
    mean, lo, hi = geomean_interval(ratios)
    return {"pairs": len(ratios), "geomean": mean, "ci90": [lo, hi]}


def target_figures(runs: list[dict]) -> dict:
    """Over a cell's repetitions: the target's llama_decode calls per
    generated token, sequences per call, milliseconds per call and its share
    of the wall time busy decoding."""
    t = {k: sum(r["target"][k] for r in runs) for k in ("decodes", "sequences", "busy")}
    gen, wall = sum(r["generated"] for r in runs), sum(r["wall"] for r in runs)
    calls = max(t["decodes"], 1.0)
    return {"target_decodes_per_token": t["decodes"] / max(gen, 1), "target_sequences_per_decode": t["sequences"] / calls,
            "target_ms_per_decode": 1e3 * t["busy"] / calls, "target_busy_share": t["busy"] / wall if wall else 0.0}


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = ["| sessions | mode | aggregate tok/s median (min–max) | × target-only | × target-only per repetition: "
             "geo-mean [90% CI] (min–max) | × one session | acceptance | drafts per token "
             "| target decodes per token | sequences per decode | ms per target decode |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "–"
        p = r["vs_target_only_paired"]
        lines.append(f"| {r['concurrency']} | {r['mode']} | {r['tok_s_median']:.1f} ({r['tok_s_min']:.1f}–{r['tok_s_max']:.1f}) "
                     f"| {r['vs_target_only']:.2f} | {p['geomean']:.2f} [{p['ci90'][0]:.2f}–{p['ci90'][1]:.2f}] "
                     f"({p['min']:.2f}–{p['max']:.2f}) | {r['vs_one_session']:.2f} | {acc} | {r['drafted_per_token']:.2f} "
                     f"| {r['target_decodes_per_token']:.3f} | {r['target_sequences_per_decode']:.2f} "
                     f"| {r['target_ms_per_decode']:.1f} |")
    lines.append("")
    lines.append(f"Machine: {result['machine']['cpus']} CPUs. Target {os.path.basename(s['target_model'])} "
                 f"({s['target_threads']} threads, {s.get('target_threads_batch', s['target_threads'])} for batches), draft {s['draft']} ({s['draft_threads']} threads), fixed and "
                 f"adaptive draft length bound {s['n_draft']}, workload {s['workload']}, {s['max_tokens']} tokens per "
                 f"request, {s['requests_per_session']} requests per session (at least {s['min_requests']} per cell), "
                 f"greedy, prompt cache off, {s['repeats']} repetitions. Greedy output mismatches across modes: "
                 f"{len(result['greedy_output_mismatches'])}.")
    pooled = result.get("pooled_under_load", {})
    levels = s["concurrency"]
    if pooled and len(levels) > 1:
        lines.append("")
        lines.append(f"× target-only per repetition, pooled over {levels[1]}–{levels[-1]} sessions: " + "; ".join(
            f"{m} {p['geomean']:.3f} [{p['ci90'][0]:.3f}–{p['ci90'][1]:.3f}] ({p['pairs']} pairs)"
            for m, p in pooled.items()) + ".")
    lines += fresh_start_lines(result.get("fresh_starts", {}))
    for m in result["greedy_output_mismatches"]:
        lines.append(f"- repetition {m['repetition']}, {m['sessions']} sessions: {m['mode']} differs from "
                     f"{m['against']} at request {m['request']}, token {m['position']} "
                     f"(expected {m['expected']}, got {m['got']})")
    return "\n".join(lines) + "\n"
