"""`specd bench --concurrency 1,2,4,8,16`: aggregate throughput under load.

One cluster (target, draft, router as processes, each worker hosting as many
sequences as the highest concurrency). For each concurrency C, C client
sessions run at once, each sending its share of the same request list one
after the other; for each mode the same requests:

- target-only: speculation off;
- fixed: draft length n_draft every step (adaptive off);
- adaptive: the router picks each step's draft length, n_draft the bound.

Aggregate tokens/s = generated tokens / wall time of the whole cell; each
repetition rotates the order of the modes. The
prompt cache is off so every mode processes every prompt. Greedy output of
each request must be identical across modes.
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

MODES = ("target-only", "fixed", "adaptive")


def _mode_kwargs(mode: str, n_draft: int) -> dict:
    if mode == "target-only":
        return {"speculative": False}
    return {"speculative": True, "n_draft": n_draft, "adaptive": mode == "adaptive"}


def run_cell(address: str, prompts: list[str], concurrency: int, max_tokens: int, kwargs: dict) -> dict:
    from specd.client import RouterClient

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


def bench_load(args) -> dict:
    from specd.bench import load_prompts, resolve_draft, resolve_target, split_drafts
    from specd.launcher import Cluster, ClusterSpec

    levels = [int(x) for x in args.concurrency.split(",")]
    draft = split_drafts(args.drafts)[0]
    n_draft = int(args.draft_lengths.split(",")[0]) if args.draft_lengths else 4
    target_model = resolve_target(args.target)
    draft_model, ngram = resolve_draft(draft)
    base_prompts = load_prompts(args.workload, 0)
    spec = ClusterSpec(target_model=target_model, draft_model=draft_model, ngram=ngram,
                       target_threads=args.target_threads, target_threads_batch=args.target_threads_batch,
                       draft_threads=args.draft_threads,
                       n_ctx=args.n_ctx, n_seq=max(levels), router_args=["--no-prompt-cache"])
    cells: dict[tuple[int, str], list[dict]] = {}
    mismatches = []
    bar = tqdm(total=len(levels) * len(MODES) * args.repeats, desc="specd bench (load)", unit="cell")
    with Cluster(spec) as cluster:
        for rep in range(args.repeats):
            for c in levels:
                n_req = max(args.requests_per_session * c, args.min_requests)
                prompts = [base_prompts[i % len(base_prompts)] for i in range(n_req)]
                ref = None
                # each repetition starts with another mode: a cell runs measurably
                # faster or slower for what ran before it (a fresh KV cache, the
                # draft's leftover work), which must not favour one mode
                for mode in MODES[rep % len(MODES):] + MODES[: rep % len(MODES)]:
                    cell = run_cell(cluster.router_address, prompts, c, args.max_tokens, _mode_kwargs(mode, n_draft))
                    cells.setdefault((c, mode), []).append(cell)
                    if ref is None:
                        ref = cell["tokens"]
                    elif cell["tokens"] != ref:
                        mismatches.append((rep, c, mode))
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
        })
    for r in rows:
        base = next(x for x in rows if x["concurrency"] == r["concurrency"] and x["mode"] == "target-only")
        one = next(x for x in rows if x["concurrency"] == levels[0] and x["mode"] == r["mode"])
        r["vs_target_only"] = r["tok_s_median"] / base["tok_s_median"]
        r["vs_one_session"] = r["tok_s_median"] / one["tok_s_median"]
        paired = paired_ratios([x["tok_s"] for x in cells[(r["concurrency"], r["mode"])]],
                               [x["tok_s"] for x in cells[(r["concurrency"], "target-only")]])
        r["vs_target_only_paired"] = {"median": statistics.median(paired), "min": min(paired), "max": max(paired)}
    return {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {"target": args.target, "target_model": target_model, "draft": draft, "n_draft": n_draft,
                     "concurrency": levels, "workload": args.workload, "max_tokens": args.max_tokens,
                     "requests_per_session": args.requests_per_session, "min_requests": args.min_requests,
                     "repeats": args.repeats, "target_threads": args.target_threads,
                     "target_threads_batch": args.target_threads_batch,
                     "draft_threads": args.draft_threads, "greedy": True, "prompt_cache": False},
        "greedy_output_mismatches": mismatches,
        "rows": sorted(rows, key=lambda r: (r["concurrency"], MODES.index(r["mode"]))),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def paired_ratios(mode_tok_s: list[float], base_tok_s: list[float]) -> list[float]:
    """Each repetition's ratio of a mode to target-only at the same load.
    The two cells of a repetition run back to back, so what drifts over a
    run (here whole cells vary by 15%: the VM, the machine's other work)
    cancels in the ratio, where medians taken apart keep it."""
    return [m / b for m, b in zip(mode_tok_s, base_tok_s) if b > 0]


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = ["| sessions | mode | aggregate tok/s median (min–max) | × target-only | × target-only per repetition: "
             "median (min–max) | × one session | acceptance | drafts per token |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "–"
        p = r["vs_target_only_paired"]
        lines.append(f"| {r['concurrency']} | {r['mode']} | {r['tok_s_median']:.1f} ({r['tok_s_min']:.1f}–{r['tok_s_max']:.1f}) "
                     f"| {r['vs_target_only']:.2f} | {p['median']:.2f} ({p['min']:.2f}–{p['max']:.2f}) "
                     f"| {r['vs_one_session']:.2f} | {acc} | {r['drafted_per_token']:.2f} |")
    lines.append("")
    lines.append(f"Machine: {result['machine']['cpus']} CPUs. Target {os.path.basename(s['target_model'])} "
                 f"({s['target_threads']} threads, {s.get('target_threads_batch', s['target_threads'])} for batches), draft {s['draft']} ({s['draft_threads']} threads), fixed and "
                 f"adaptive draft length bound {s['n_draft']}, workload {s['workload']}, {s['max_tokens']} tokens per "
                 f"request, {s['requests_per_session']} requests per session (at least {s['min_requests']} per cell), "
                 f"greedy, prompt cache off, {s['repeats']} repetitions. Greedy output mismatches across modes: "
                 f"{len(result['greedy_output_mismatches'])}.")
    return "\n".join(lines) + "\n"
