"""`specd bench --protocols grpc,http --concurrency 1,8`: what the router's
OpenAI-compatible HTTP API costs beside gRPC.

One cluster (target, draft, router with its HTTP port). For each
concurrency C and repetition, the same requests run over each protocol in
turn (the order alternates between repetitions), C client sessions at once,
each sending its share one after the other: over gRPC with specd's client
(RouterClient), over HTTP as a streaming /v1/completions with a plain httpx
client parsing the Server-Sent Events (what any OpenAI client does, without
its own overhead). Speculative with a fixed draft length, greedy; the
prompt cache is off, so every request processes its prompt. Each request's
latency is measured by the client, from sending to the last byte; the
overhead of HTTP is the paired difference per request (same prompt, same
repetition). Greedy output must be identical over both.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from specd.bench_common import balanced_order, draft_length, load_prompts, progress, split_drafts
from specd.models import resolve_draft, resolve_target

PROTOCOLS = ("grpc", "http")


@dataclass
class Sample:
    """One request as its client saw it."""

    seconds: float
    n_generated: int
    tokens: list[int] = field(default_factory=list)


def _grpc(client, prompt: str, max_tokens: int, n_draft: int) -> Sample:
    t0 = time.perf_counter()
    c = client.generate(prompt, max_tokens=max_tokens, speculative=True, n_draft=n_draft, adaptive=False)
    return Sample(time.perf_counter() - t0, c.n_generated, c.tokens)


def _http(client, url: str, prompt: str, max_tokens: int, n_draft: int) -> Sample:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True,
            "speculative": {"enabled": True, "n_max": n_draft, "adaptive": False}}
    tokens, usage = [], {}
    t0 = time.perf_counter()
    with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if event["choices"]:
                tokens += event["choices"][0].get("token_ids", [])
            usage = event.get("usage") or usage
    return Sample(time.perf_counter() - t0, usage.get("completion_tokens", 0), tokens)


def run_cell(cluster, protocol: str, prompts: list[str], concurrency: int, max_tokens: int,
             n_draft: int) -> dict:
    import httpx  # optional (the bench extra)

    from specd.client import RouterClient  # loads gRPC: not at CLI start

    shares = [list(range(len(prompts)))[i::concurrency] for i in range(concurrency)]
    url = cluster.http_url + "/v1/completions"
    with RouterClient(cluster.router_address, timeout=1800) as g, httpx.Client(timeout=1800) as h:
        def one(i: int) -> Sample:
            if protocol == "grpc":
                return _grpc(g, prompts[i], max_tokens, n_draft)
            return _http(h, url, prompts[i], max_tokens, n_draft)

        def session(share: list[int]) -> list[tuple[int, Sample]]:
            return [(i, one(i)) for i in share]

        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            done = [x for part in pool.map(session, shares) for x in part]
        wall = time.perf_counter() - t0
    samples = [s for _, s in sorted(done, key=lambda x: x[0])]
    return {"wall": wall, "tok_s": sum(s.n_generated for s in samples) / wall,
            "seconds": [s.seconds for s in samples], "tokens": [s.tokens for s in samples]}


def bench_protocols(args) -> dict:
    from specd.launcher import Cluster, ClusterSpec  # loads gRPC: not at CLI start

    protocols = args.protocols  # checked by the flag's type: two or more of PROTOCOLS
    levels = [int(x) for x in (args.concurrency or "1,8").split(",")]
    n_draft = draft_length(args)
    draft_model, ngram = resolve_draft(split_drafts(args.drafts)[0])
    base_prompts = load_prompts(args.workload, args.prompts)
    spec = ClusterSpec(target_model=resolve_target(args.target), draft_model=draft_model, ngram=ngram,
                       target_threads=args.target_threads, target_threads_batch=args.target_threads_batch,
                       draft_threads=args.draft_threads, n_ctx=args.n_ctx, n_seq=max(levels), http=True,
                       router_args=["--no-prompt-cache"])
    cells: dict[tuple[int, str], list[dict]] = {}
    mismatches = []
    bar = progress(total=len(levels) * len(protocols) * args.repeats, desc="specd bench (protocols)", unit="cell")
    with Cluster(spec) as cluster:
        run_cell(cluster, "http", base_prompts[:1], 1, 4, n_draft)  # warm both workers' buffers first
        for rep in range(args.repeats):
            for c in levels:
                n_req = max(args.requests_per_session * c, args.min_requests)
                prompts = [base_prompts[i % len(base_prompts)] for i in range(n_req)]
                for protocol in balanced_order(list(protocols), rep):
                    cell = run_cell(cluster, protocol, prompts, c, args.max_tokens, n_draft)
                    cell["repetition"] = rep
                    cells.setdefault((c, protocol), []).append(cell)
                    bar.update(1)
                    bar.set_postfix_str(f"C={c} {protocol}: {statistics.mean(cell['seconds']) * 1e3:.0f} ms/request")
                ref = cells[(c, protocols[0])][-1]["tokens"]
                for p in protocols[1:]:
                    got = cells[(c, p)][-1]["tokens"]
                    mismatches += [{"repetition": rep, "sessions": c, "protocol": p, "request": i}
                                   for i, (a, b) in enumerate(zip(ref, got)) if a != b]
    bar.close()
    return {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {"target": args.target, "draft": split_drafts(args.drafts)[0], "n_draft": n_draft,
                     "concurrency": levels, "protocols": list(protocols), "max_tokens": args.max_tokens,
                     "repeats": args.repeats, "workload": args.workload, "prompt_cache": False, "greedy": True},
        "rows": [row(cells, c, p, protocols[0]) for c in levels for p in protocols],
        "greedy_output_mismatches": mismatches,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def row(cells: dict, c: int, protocol: str, base: str) -> dict:
    runs = cells[(c, protocol)]
    seconds = [s for r in runs for s in r["seconds"]]
    # paired: the same request of the same repetition over the base protocol
    diffs = [a - b for r, rb in zip(runs, cells[(c, base)]) for a, b in zip(r["seconds"], rb["seconds"])]
    return {"concurrency": c, "protocol": protocol, "requests": len(seconds),
            "latency_ms_mean": 1e3 * statistics.mean(seconds), "latency_ms_median": 1e3 * statistics.median(seconds),
            "tok_s_median": statistics.median(r["tok_s"] for r in runs),
            f"minus_{base}_ms_median": 1e3 * statistics.median(diffs),
            f"minus_{base}_ms_mean": 1e3 * statistics.mean(diffs)}


def markdown(result: dict) -> str:
    s = result["settings"]
    base = s["protocols"][0]
    lines = [f"specd bench --protocols: {s['max_tokens']} tokens a request, n_draft {s['n_draft']}, "
             f"{s['repeats']} repetitions, greedy, prompt cache off", "",
             f"| sessions | protocol | requests | latency ms mean | median | minus {base}, ms median (mean) | tok/s |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['concurrency']} | {r['protocol']} | {r['requests']} | {r['latency_ms_mean']:.1f} | "
                     f"{r['latency_ms_median']:.1f} | {r[f'minus_{base}_ms_median']:+.1f} "
                     f"({r[f'minus_{base}_ms_mean']:+.1f}) | {r['tok_s_median']:.1f} |")
    lines += ["", f"greedy output mismatches: {len(result['greedy_output_mismatches'])}"]
    return "\n".join(lines) + "\n"
