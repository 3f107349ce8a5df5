"""What every `specd bench` mode shares: the prompts, the --drafts list, the
draft length, the clusters of a run, per-request figures (`Run`, `Cell`)
and the statistics that compare modes (paired ratios, their geometric mean
with a bootstrap interval, the order of the modes, where outputs differ).

Imported by each mode (bench_single, bench_load, bench_http, bench_server,
bench_temperature), never the other way round. `specd.bench`, which every
`specd` command imports to build its parser, reaches this module: what needs
gRPC, the router or llama.cpp is imported inside the function using it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import random
import statistics
from dataclasses import dataclass, field

BENCH_DIR = pathlib.Path(__file__).resolve().parent.parent / "bench"


@dataclass
class Run:
    """One request's measurements, whatever the mode."""

    n_generated: int
    n_drafted: int
    n_accepted: int
    n_steps: int
    generation_seconds: float
    draft_compute: float
    verify_compute: float
    steps_seconds: float
    critical_compute: float
    tokens: list[int] = field(default_factory=list)


@dataclass
class Cell:
    mode: str  # target-only | in-process | distributed
    draft: str
    n_draft: int
    reps: list[float] = field(default_factory=list)  # tokens/s per repetition
    runs: list[Run] = field(default_factory=list)

    def summary(self) -> dict:
        gen = sum(r.n_generated for r in self.runs)
        steps = sum(r.n_steps for r in self.runs) or 1
        drafted = sum(r.n_drafted for r in self.runs)
        accepted = sum(r.n_accepted for r in self.runs)
        per_step_overhead = [(r.steps_seconds - r.critical_compute) / r.n_steps for r in self.runs if r.n_steps]
        return {
            "mode": self.mode, "draft": self.draft, "n_draft": self.n_draft,
            "tok_s_median": statistics.median(self.reps), "tok_s_min": min(self.reps), "tok_s_max": max(self.reps),
            "acceptance": accepted / drafted if drafted else None,
            "mean_accepted_length": gen / steps,
            "draft_ms_per_step": 1000 * sum(r.draft_compute for r in self.runs) / steps,
            "verify_ms_per_step": 1000 * sum(r.verify_compute for r in self.runs) / steps,
            "critical_compute_ms_per_step": 1000 * sum(r.critical_compute for r in self.runs) / steps,
            "overhead_ms_per_step_mean": 1000 * sum(r.steps_seconds - r.critical_compute for r in self.runs) / steps,
            "overhead_share_of_step": sum(r.steps_seconds - r.critical_compute for r in self.runs)
            / max(sum(r.steps_seconds for r in self.runs), 1e-9),
            "overhead_ms_per_step_median": 1000 * statistics.median(per_step_overhead) if per_step_overhead else None,
        }


def tok_s(runs: list[Run]) -> float:
    return sum(r.n_generated for r in runs) / sum(r.generation_seconds for r in runs)


def progress(**kw):
    """A tqdm progress bar; tqdm comes with the bench extra."""
    try:
        from tqdm import tqdm  # optional (the bench extra): imported when a bench runs
    except ImportError:
        raise SystemExit("specd bench needs the bench extra: pip install 'specd[bench]'") from None
    return tqdm(**kw)


def load_prompts(name: str, limit: int) -> list[str]:
    path = pathlib.Path(name)
    if not path.is_file():
        path = BENCH_DIR / f"{name}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["prompt"] for r in rows][:limit] if limit else [r["prompt"] for r in rows]


def split_drafts(text: str) -> list[str]:
    """The --drafts list: comma-separated, where an n-gram chain keeps its
    commas ("q4_1,ngram:map-k,cache" -> ["q4_1", "ngram:map-k,cache"])."""
    from specd.draft_worker.ngram import PROPOSER_NAMES  # the n-gram package loads numpy: not at CLI start

    drafts: list[str] = []
    for part in (d.strip() for d in text.split(",")):
        if not part:
            continue
        if drafts and drafts[-1].lower().startswith("ngram:") and part.split(":")[0] in PROPOSER_NAMES:
            drafts[-1] += "," + part
        else:
            drafts.append(part)
    return drafts


def draft_length(args) -> int:
    """The draft length of the modes that run one (load, protocols,
    temperatures, llama-server): the first of --draft-lengths if given,
    else what `specd router` uses by default."""
    from specd.router.params import RouterSettings  # the router's whole engine: not at CLI start

    return int(args.draft_lengths.split(",")[0]) if args.draft_lengths else RouterSettings.n_max


def clusters(spec, repeats: int, fresh: bool):
    """(repetition, cluster) for each repetition: one cluster for all or,
    `fresh`, a new one each time with both workers started at once (as
    Kubernetes starts pods), each timing its decodes beside the other: a
    start whose adaptive speculation never drafts then shows in the figures."""
    from specd.launcher import Cluster  # loads gRPC: not at CLI start

    if not fresh:
        with Cluster(spec) as cluster:
            for rep in range(repeats):
                yield rep, cluster
        return
    for rep in range(repeats):
        with Cluster(dataclasses.replace(spec, start_together=True)) as cluster:
            yield rep, cluster


def fresh_start_summary(drafted_tokens: list[int]) -> dict:
    """Of fresh starts, each given by the tokens its adaptive cells drafted:
    how many drafted at all (one that never drafts is issue #24's lock-out)."""
    drafted = sum(1 for n in drafted_tokens if n > 0)
    return {"starts": len(drafted_tokens), "drafted": drafted,
            "share": drafted / len(drafted_tokens) if drafted_tokens else None, "drafted_tokens": drafted_tokens}


def fresh_start_lines(fresh: dict) -> list[str]:
    """Markdown for `fresh_starts` ({label: fresh_start_summary})."""
    return [f"Fresh starts ({label}): adaptive speculation drafted in {f['drafted']} of {f['starts']} "
            f"(tokens drafted per start: {', '.join(map(str, f['drafted_tokens']))})." for label, f in fresh.items()]


# ------------------------------------------------------------------ comparing modes
def balanced_order(items: list, rep: int) -> list:
    """The order of `items` in repetition `rep`, a Williams design: over n
    repetitions (2n for an odd number n) each item runs once in each place
    and right after each other item equally often. A cell runs faster or
    slower for what ran before it; rotating one order would put the same
    contender always right after the same other."""
    n = len(items)
    base, lo, hi = [0], 1, n - 1
    while len(base) < n:
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    r = rep % (n if n % 2 == 0 else 2 * n)
    order = [items[(b + r) % n] for b in base]
    return order[::-1] if r >= n else order


def first_difference(ref: list[list[int]], got: list[list[int]]) -> tuple[int, int]:
    """(request, token position) where two cells' greedy outputs first
    differ; a missing or extra token counts as a difference at its place."""
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            return i, next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return min(len(ref), len(got)), 0


def difference(ref: list[list[int]], got: list[list[int]]) -> dict:
    """Where two cells' greedy outputs first differ, and up to 4 tokens on each
    side from there (none where a side has no such request)."""
    request, position = first_difference(ref, got)

    def tokens(outputs: list[list[int]]) -> list[int]:
        return outputs[request][position:position + 4] if request < len(outputs) else []

    return {"request": request, "position": position, "expected": tokens(ref), "got": tokens(got)}


def paired_ratios(mode_tok_s: list[float], base_tok_s: list[float]) -> list[float]:
    """Each repetition's ratio of a mode to target-only at the same load.
    The two cells of a repetition run back to back, so what drifts over a
    run (whole cells drift with the VM and the machine's other work)
    cancels in the ratio, where medians taken apart keep it."""
    return [m / b for m, b in zip(mode_tok_s, base_tok_s) if b > 0]


def geomean_interval(ratios: list[float], level: float = 0.90, resamples: int = 10000,
                     seed: int = 0) -> tuple[float, float, float]:
    """Geometric mean of ratios and its bootstrap percentile interval
    (deterministic: a fixed seed). Ratios multiply, so they are averaged as
    logarithms: 0.8 and 1.25 average to 1."""
    if not ratios:
        return float("nan"), float("nan"), float("nan")
    logs = [math.log(r) for r in ratios]
    rng = random.Random(seed)
    n = len(logs)
    means = sorted(sum(rng.choice(logs) for _ in range(n)) / n for _ in range(resamples))
    tail = (1.0 - level) / 2.0
    lo, hi = means[int(tail * (resamples - 1))], means[int((1.0 - tail) * (resamples - 1))]
    return math.exp(sum(logs) / n), math.exp(lo), math.exp(hi)
