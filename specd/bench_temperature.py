"""`specd bench --temperatures 0,0.7,1.0`: sampled decoding side by side.

For each temperature, on one distributed cluster per draft: target-only,
then speculative decoding with exact-match acceptance and with speculative
sampling ("rejection"), at the first --draft-lengths and adaptive. Each
prompt is generated with the same seed in every mode. Greedy (T = 0) has a
single acceptance rule, reported as "exact".
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from specd.bench_common import Cell, Run, draft_length, load_prompts, split_drafts, tok_s
from specd.models import resolve_draft, resolve_target

ACCEPTANCES = ("exact", "rejection")


def parse_temperatures(text: str) -> tuple[float, ...]:
    """The --temperatures list: comma-separated, each >= 0."""
    try:
        temps = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"temperatures must be numbers, got {text!r}") from None
    if not temps or any(t < 0 for t in temps):
        raise argparse.ArgumentTypeError(f"give one or more temperatures >= 0, got {text!r}")
    return temps


def modes(temperature: float) -> list[tuple[str, str]]:
    """(acceptance, length) of the speculative rows at one temperature."""
    accs = ("exact",) if temperature == 0 else ACCEPTANCES
    return [(a, length) for a in accs for length in ("fixed", "adaptive")]


def _runs(client, prompts, max_tokens: int, temperature: float, speculative: bool, **kw) -> list[Run]:
    out = []
    for i, p in enumerate(prompts):
        c = client.generate(p, max_tokens=max_tokens, temperature=temperature, seed=1234 + i,
                            speculative=speculative, **kw)
        out.append(Run(c.n_generated, c.n_drafted, c.n_accepted, c.n_steps, c.generation_seconds,
                       c.draft_compute_seconds, c.verify_compute_seconds, c.steps_seconds,
                       c.critical_compute_seconds, c.tokens))
    return out


def bench_temperatures(args) -> dict:
    from specd.client import RouterClient  # loads gRPC: not at CLI start
    from specd.launcher import Cluster, ClusterSpec

    target_model = resolve_target(args.target)
    prompts = load_prompts(args.workload, args.prompts)
    n = draft_length(args)
    rows = []
    for draft in split_drafts(args.drafts):
        draft_model, ngram = resolve_draft(draft)
        spec = ClusterSpec(target_model=target_model, draft_model=draft_model, ngram=ngram,
                           target_threads=args.target_threads, target_threads_batch=args.target_threads_batch,
                           draft_threads=args.draft_threads, n_ctx=args.n_ctx, n_seq=1)
        with Cluster(spec) as cluster, RouterClient(cluster.router_address) as client:
            for temp in args.temperatures:
                cells = {("target-only", "-"): Cell("target-only", draft, 0)}
                cells.update({m: Cell(f"{m[0]} {m[1]}", draft, n) for m in modes(temp)})
                for _ in range(args.repeats):
                    for (acc, length), cell in cells.items():
                        spec_on = acc != "target-only"
                        kw = {"n_draft": n, "adaptive": length == "adaptive", "acceptance": acc} if spec_on else {}
                        runs = _runs(client, prompts, args.max_tokens, temp, spec_on, **kw)
                        cell.reps.append(tok_s(runs))
                        cell.runs.extend(runs)
                base = statistics.median(cells[("target-only", "-")].reps)
                for (acc, length), cell in cells.items():
                    s = cell.summary()
                    rows.append({"draft": draft, "temperature": temp, "acceptance": acc, "length": length,
                                 "n_draft": n if acc != "target-only" else 0,
                                 "tok_s_median": s["tok_s_median"], "tok_s_min": s["tok_s_min"],
                                 "tok_s_max": s["tok_s_max"], "acceptance_rate": s["acceptance"],
                                 "tokens_per_step": s["mean_accepted_length"],
                                 "speedup_vs_target_only": s["tok_s_median"] / base})
    return {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {"target": args.target, "target_model": target_model, "drafts": split_drafts(args.drafts),
                     "n_draft": n, "temperatures": list(args.temperatures), "workload": args.workload,
                     "prompts": len(prompts), "max_tokens": args.max_tokens, "repeats": args.repeats},
        "rows": rows,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def markdown(result: dict) -> str:
    lines = ["| draft | T | acceptance | draft length | acceptance rate | tokens/step | tok/s median (min–max) "
             "| × target-only |", "|" + "---|" * 8]
    for r in result["rows"]:
        acc = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "–"
        length = "–" if r["acceptance"] == "target-only" else (
            f"{r['n_draft']}" if r["length"] == "fixed" else f"adaptive ≤ {r['n_draft']}")
        lines.append(f"| {r['draft']} | {r['temperature']:g} | {r['acceptance']} | {length} | {acc} "
                     f"| {r['tokens_per_step']:.2f} | {r['tok_s_median']:.1f} ({r['tok_s_min']:.1f}–{r['tok_s_max']:.1f}) "
                     f"| {r['speedup_vs_target_only']:.2f} |")
    s = result["settings"]
    lines.append("")
    lines.append(f"Target {os.path.basename(s['target_model'])}, workload {s['workload']} ({s['prompts']} prompts × "
                 f"{s['max_tokens']} tokens, one seed per prompt, the same in every mode), {s['repeats']} "
                 f"repetitions, {result['machine']['cpus']} CPUs.")
    return "\n".join(lines) + "\n"
