"""`specd bench` (the default mode): target-only, in-process and distributed
speculative decoding side by side, one session at a time, in one run, on one
machine, one prompt set, one set of settings.

- target-only: through specd with speculation off (distributed processes);
- in-process: the router's own loop (router.engine.Router) driving both
  llama.cpp contexts in this process through LocalWorker: no gRPC;
- distributed: router, target and draft as separate processes over gRPC.

The same Router class runs in both speculative modes; only the transport
differs. Results: JSON, a markdown table and a PNG plot in --out.
"""
from __future__ import annotations

import asyncio
import os
import pathlib
import platform
import time

from specd.bench_common import (Cell, Run, clusters, difference, fresh_start_lines, fresh_start_summary,
                                 load_prompts, progress, split_drafts, tok_s)
from specd.models import resolve_draft, resolve_target

SWEEP_LENGTHS = "1,2,4,8"


def run_distributed(address: str, prompts: list[str], max_tokens: int, n_draft: int | None, speculative: bool) -> list[Run]:
    from specd.client import RouterClient  # loads gRPC: not at CLI start

    out = []
    with RouterClient(address) as client:
        for p in prompts:
            c = client.generate(p, max_tokens=max_tokens, speculative=speculative, n_draft=n_draft)
            out.append(Run(c.n_generated, c.n_drafted, c.n_accepted, c.n_steps, c.generation_seconds,
                           c.draft_compute_seconds, c.verify_compute_seconds, c.steps_seconds,
                           c.critical_compute_seconds, c.tokens))
    return out


class InProcess:
    """Both engines in this process, the router's loop over LocalWorker."""

    def __init__(self, target_model: str, draft_model: str, ngram: str, args):
        # llama.cpp: only the in-process mode loads it into the bench's own process
        from specd.draft_worker.engine import DraftModelEngine, NgramEngine
        from specd.llama import LlamaConfig
        from specd.target_worker.engine import TargetEngine

        self.target = TargetEngine(LlamaConfig(target_model, n_ctx_seq=args.n_ctx, n_seq=1, n_threads=args.target_threads,
                                                 n_threads_batch=args.target_threads_batch))
        self.draft_holds_model = not ngram  # a DraftModelEngine, whose llama.cpp model close() frees
        if ngram:
            self.draft = NgramEngine(ngram, 1, args.n_ctx)
        else:
            self.draft = DraftModelEngine(LlamaConfig(draft_model, n_ctx_seq=args.n_ctx, n_seq=1, n_threads=args.draft_threads))

    def run(self, prompts: list[str], max_tokens: int, n_draft: int) -> list[Run]:
        return asyncio.run(self._run(prompts, max_tokens, n_draft))

    async def _run(self, prompts, max_tokens, n_draft) -> list[Run]:
        from specd.router.clients import LocalWorker  # the router's engine: not at CLI start
        from specd.router.engine import Router
        from specd.router.params import GenParams, Result, RouterSettings

        t, d = LocalWorker(self.target, "target"), LocalWorker(self.draft, "draft")
        router = Router(t, d, RouterSettings())
        await router.start()
        out = []
        for p in prompts:
            res = Result()
            toks = []
            prompt = self.target.tokenize(p, True, True)
            async for step in router.generate(GenParams(prompt=prompt, max_tokens=max_tokens, n_max=n_draft), res):
                toks += step.tokens
            out.append(Run(res.n_generated, res.n_drafted, res.n_accepted, res.n_steps, res.generation_seconds,
                           res.draft_compute_seconds, res.verify_compute_seconds, res.steps_seconds,
                           res.critical_compute_seconds, toks))
        await t.close()
        await d.close()
        return out

    def close(self) -> None:
        self.target.model.close()
        if self.draft_holds_model:
            self.draft.model.close()


def _differences(mode: str, draft: str, n: int, rep: int, runs: list[Run], baseline: list[list[int]]) -> list[dict]:
    """The cell's greedy difference from target-only, if any, with its request
    and first differing token (a near-tie shows as a flip there)."""
    got = [r.tokens for r in runs]
    if got == baseline:
        return []
    return [{"mode": mode, "draft": draft, "n_draft": n, "repetition": rep, **difference(baseline, got)}]


def bench(args) -> dict:
    from specd.launcher import ClusterSpec  # loads gRPC: not at CLI start

    target_model = resolve_target(args.target)
    prompts = load_prompts(args.workload, args.prompts)
    drafts = split_drafts(args.drafts)
    lengths = [int(x) for x in (args.draft_lengths or SWEEP_LENGTHS).split(",")]
    cells: dict[tuple, Cell] = {}
    total = args.repeats * (1 + len(drafts) * len(lengths) * (2 if args.in_process else 1))
    bar = progress(total=total, desc="specd bench", unit="run")
    mismatches = []
    baseline_tokens: list[list[int]] = []
    starts: dict[str, list[int]] = {}  # per draft, per fresh start: tokens its distributed (adaptive) cells drafted

    def record(mode, draft, n, runs):
        cell = cells.setdefault((mode, draft, n), Cell(mode, draft, n))
        cell.reps.append(tok_s(runs))
        cell.runs.extend(runs)
        bar.update(1)
        bar.set_postfix_str(f"{mode} {draft} n={n}: {cell.reps[-1]:.1f} tok/s")
        return runs

    for draft in drafts:
        draft_model, ngram = resolve_draft(draft)
        spec = ClusterSpec(target_model=target_model, draft_model=draft_model, ngram=ngram,
                           target_threads=args.target_threads, target_threads_batch=args.target_threads_batch,
                           draft_threads=args.draft_threads,
                           n_ctx=args.n_ctx, n_seq=1)
        inproc = InProcess(target_model, draft_model, ngram, args) if args.in_process else None
        for rep, cluster in clusters(spec, args.repeats, args.fresh_starts):
            if ("target-only", "-", 0) not in cells or len(cells[("target-only", "-", 0)].reps) <= rep:
                base = record("target-only", "-", 0, run_distributed(cluster.router_address, prompts, args.max_tokens, None, False))
                baseline_tokens = baseline_tokens or [r.tokens for r in base]
            starts.setdefault(draft, []).append(0)
            for n in lengths:
                runs = record("distributed", draft, n, run_distributed(cluster.router_address, prompts, args.max_tokens, n, True))
                starts[draft][-1] += sum(r.n_drafted for r in runs)
                mismatches += _differences("distributed", draft, n, rep, runs, baseline_tokens)
                if inproc is not None:
                    runs = record("in-process", draft, n, inproc.run(prompts, args.max_tokens, n))
                    mismatches += _differences("in-process", draft, n, rep, runs, baseline_tokens)
        if inproc is not None:
            inproc.close()
    bar.close()
    rows = [c.summary() for c in cells.values()]
    base = next(r for r in rows if r["mode"] == "target-only")["tok_s_median"]
    for r in rows:
        r["speedup_vs_target_only"] = r["tok_s_median"] / base
        if r["mode"] == "distributed":
            ip = next((x for x in rows if x["mode"] == "in-process" and x["draft"] == r["draft"] and x["n_draft"] == r["n_draft"]), None)
            r["distributed_over_in_process"] = r["tok_s_median"] / ip["tok_s_median"] if ip else None
    return {
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {"target": args.target, "target_model": target_model, "drafts": drafts, "draft_lengths": lengths,
                     "workload": args.workload, "prompts": len(prompts), "max_tokens": args.max_tokens,
                     "repeats": args.repeats, "target_threads": args.target_threads,
                     "target_threads_batch": args.target_threads_batch, "draft_threads": args.draft_threads,
                     "greedy": True, "fresh_starts": args.fresh_starts},
        "greedy_output_mismatches": mismatches,
        "fresh_starts": {d: fresh_start_summary(n) for d, n in starts.items()} if args.fresh_starts else {},
        "rows": rows,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def markdown(result: dict) -> str:
    head = ("| mode | draft | n_draft | tok/s median (min–max) | × target-only | distributed ÷ in-process | acceptance "
            "| mean accepted length | draft ms/step | verify ms/step | critical-path compute ms/step | router+RPC ms/step (median) | router+RPC share of step |")
    lines = [head, "|" + "---|" * 13]
    for r in result["rows"]:
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "–"
        ratio = f"{r['distributed_over_in_process']:.3f}" if r.get("distributed_over_in_process") else "–"
        med = r["overhead_ms_per_step_median"]
        lines.append(
            f"| {r['mode']} | {r['draft']} | {r['n_draft'] or '–'} | {r['tok_s_median']:.1f} ({r['tok_s_min']:.1f}–{r['tok_s_max']:.1f}) "
            f"| {r['speedup_vs_target_only']:.2f} | {ratio} | {acc} | {r['mean_accepted_length']:.2f} "
            f"| {r['draft_ms_per_step']:.1f} | {r['verify_ms_per_step']:.1f} | {r['critical_compute_ms_per_step']:.1f} "
            f"| {med:.2f} | {100 * r['overhead_share_of_step']:.1f} % |"
        )
    s = result["settings"]
    lines.append("")
    lines.append(f"Machine: {result['machine']['cpus']} CPUs, {result['machine']['processor']}, {result['machine']['platform']}. "
                 f"Target {os.path.basename(s['target_model'])} ({s['target_threads']} threads, {s.get('target_threads_batch', s['target_threads'])} for batches), drafts {', '.join(s['drafts'])} "
                 f"({s['draft_threads']} thread), workload {s['workload']} ({s['prompts']} prompts × {s['max_tokens']} tokens, "
                 f"greedy), {s['repeats']} repetitions. Greedy output mismatches: {len(result['greedy_output_mismatches'])}.")
    lines += [f"- {m['mode']} {m['draft']} n={m['n_draft']}, repetition {m['repetition']}: request {m['request']}, "
              f"token {m['position']} (expected {m['expected']}, got {m['got']})"
              for m in result["greedy_output_mismatches"]]
    lines += fresh_start_lines(result.get("fresh_starts", {}))
    return "\n".join(lines) + "\n"


def plot(result: dict, path: pathlib.Path) -> bool:
    try:  # optional (the bench extra), and slow to import: only when a plot is drawn
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    base = next(r for r in result["rows"] if r["mode"] == "target-only")["tok_s_median"]
    series: dict[tuple, list] = {}
    for r in result["rows"]:
        if r["mode"] != "target-only":
            series.setdefault((r["mode"], r["draft"]), []).append((r["n_draft"], r["tok_s_median"]))
    for (mode, draft), pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linestyle="-" if mode == "distributed" else "--",
                label=f"{mode}, draft {draft}")
    ax.axhline(base, color="black", linewidth=1, label="target-only")
    ax.set_xlabel("draft length (tokens per step)")
    ax.set_ylabel("tokens/s (median)")
    ax.set_xscale("log", base=2)
    ax.set_title("specd: speculative decoding, " + os.path.basename(result["settings"]["target_model"]))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
