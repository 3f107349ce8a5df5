"""`specd bench`: target-only, in-process and distributed speculative decoding
side by side, in one run, on one machine, one prompt set, one set of settings.

- target-only: through specd with speculation off (distributed processes);
- in-process: the router's own loop (router.engine.Router) driving both
  llama.cpp contexts in this process through LocalWorker: no gRPC;
- distributed: router, target and draft as separate processes over gRPC.

The same Router class runs in both speculative modes; only the transport
differs. Results: JSON, a markdown table and a PNG plot in --out.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import pathlib
import platform
import statistics
import time
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


def progress(**kw):
    """A tqdm progress bar; tqdm comes with the bench extra."""
    try:
        from tqdm import tqdm
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
    from specd.draft_worker.ngram import PROPOSER_NAMES

    drafts: list[str] = []
    for part in (d.strip() for d in text.split(",")):
        if not part:
            continue
        if drafts and drafts[-1].lower().startswith("ngram:") and part.split(":")[0] in PROPOSER_NAMES:
            drafts[-1] += "," + part
        else:
            drafts.append(part)
    return drafts


def resolve_draft(name: str) -> tuple[str, str]:
    """(model path, ngram spec) of a draft name: q4_1, q2_k, q8_0, ngram:SPEC or a path."""
    from specd.models import default_models, derived_model

    low = name.lower()
    if low.startswith("ngram:"):
        return "", name.split(":", 1)[1]
    if low == "q4_1":
        return default_models(quiet=True)["draft"], ""
    if low in ("q2_k", "q8_0", "f16"):
        return derived_model(name.upper(), quiet=True), ""
    return name, ""


def resolve_target(name: str) -> str:
    """smollm2 (F32, derived from the Q4_1 file), gemma3 (Q4_K_M as shipped),
    NAME:FTYPE for another precision derived from it (gemma3:F32) or a path."""
    import pathlib

    from specd.models import default_models, derive, gemma3_model

    base, _, ftype = name.partition(":")
    if base not in ("smollm2", "gemma3"):
        return name
    path = pathlib.Path(default_models(quiet=True)["target"] if base == "smollm2" else gemma3_model(quiet=True))
    if not ftype:
        return str(path)
    return str(derive(path, path.with_name(f"{path.name.split('.')[0]}.{ftype.upper()}.gguf"), ftype.upper(), quiet=True))


# ------------------------------------------------------------------ modes
def run_distributed(address: str, prompts: list[str], max_tokens: int, n_draft: int | None, speculative: bool) -> list[Run]:
    from specd.client import RouterClient

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
        from specd.draft_worker.engine import DraftModelEngine, NgramEngine
        from specd.llama import LlamaConfig
        from specd.target_worker.engine import TargetEngine

        self.target = TargetEngine(LlamaConfig(target_model, n_ctx_seq=args.n_ctx, n_seq=1, n_threads=args.target_threads,
                                                 n_threads_batch=args.target_threads_batch))
        if ngram:
            self.draft = NgramEngine(ngram, 1, args.n_ctx)
        else:
            self.draft = DraftModelEngine(LlamaConfig(draft_model, n_ctx_seq=args.n_ctx, n_seq=1, n_threads=args.draft_threads))

    def run(self, prompts: list[str], max_tokens: int, n_draft: int) -> list[Run]:
        return asyncio.run(self._run(prompts, max_tokens, n_draft))

    async def _run(self, prompts, max_tokens, n_draft) -> list[Run]:
        from specd.router.clients import LocalWorker
        from specd.router.engine import GenParams, Result, Router, RouterSettings

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
        if hasattr(self.draft, "model"):
            self.draft.model.close()


def tok_s(runs: list[Run]) -> float:
    return sum(r.n_generated for r in runs) / sum(r.generation_seconds for r in runs)


def clusters(spec, repeats: int, fresh: bool):
    """(repetition, cluster) for each repetition: one cluster for all or,
    `fresh`, a new one each time with both workers started at once (as
    Kubernetes starts pods), each timing its decodes beside the other: a
    start whose adaptive speculation never drafts then shows in the figures."""
    from specd.launcher import Cluster

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


# ------------------------------------------------------------------ main
SWEEP_LENGTHS = "1,2,4,8"


def draft_length(args) -> int:
    """The draft length of the modes that run one (load, protocols,
    temperatures, llama-server): the first of --draft-lengths if given,
    else what `specd router` uses by default."""
    from specd.router.engine import RouterSettings

    return int(args.draft_lengths.split(",")[0]) if args.draft_lengths else RouterSettings.n_max


def bench(args) -> dict:
    from specd.launcher import ClusterSpec

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
                if [r.tokens for r in runs] != baseline_tokens:
                    mismatches.append(("distributed", draft, n))
                if inproc is not None:
                    runs = record("in-process", draft, n, inproc.run(prompts, args.max_tokens, n))
                    if [r.tokens for r in runs] != baseline_tokens:
                        mismatches.append(("in-process", draft, n))
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
    lines += fresh_start_lines(result.get("fresh_starts", {}))
    return "\n".join(lines) + "\n"


def fresh_start_lines(fresh: dict) -> list[str]:
    """Markdown for `fresh_starts` ({label: fresh_start_summary})."""
    return [f"Fresh starts ({label}): adaptive speculation drafted in {f['drafted']} of {f['starts']} "
            f"(tokens drafted per start: {', '.join(map(str, f['drafted_tokens']))})." for label, f in fresh.items()]


def plot(result: dict, path: pathlib.Path) -> bool:
    try:
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


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark target-only, in-process and distributed speculative decoding")
    p.add_argument("--target", default="smollm2", help="smollm2 | gemma3 | NAME:FTYPE (e.g. gemma3:F32, derived) | PATH")
    p.add_argument("--drafts", default="q4_1,q2_k", help="comma list: q4_1, q2_k, q8_0, ngram:SPEC or a path")
    p.add_argument("--draft-lengths", default="",
                   help="comma list; default 1,2,4,8 for the draft sweep, the router's n_max for the other modes")
    p.add_argument("--workload", default="prompts", help="bench/NAME.jsonl or a path")
    p.add_argument("--prompts", type=int, default=0, help="use the first N prompts (0: all)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fresh-starts", action="store_true",
                   help="each repetition on a new cluster whose workers start at the same moment (as Kubernetes "
                        "starts pods); reports how many starts drafted (distributed cells are adaptive)")
    p.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--target-threads", type=int, default=1)
    p.add_argument("--target-threads-batch", type=int, default=os.cpu_count() or 1,
                   help="target threads for multi-token batches (default: all cores, as `specd up`)")
    p.add_argument("--draft-threads", type=int, default=1)
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--out", default="results", help="folder for bench.json, bench.md, bench.png")
    p.add_argument("--concurrency", default="",
                   help="load benchmark instead: comma list of concurrent sessions, e.g. 1,2,4,8,16 (target-only, "
                        "fixed and adaptive draft length; uses the first of --drafts and --draft-lengths)")
    p.add_argument("--protocols", type=_protocols, default="",
                   help="protocol benchmark instead: comma list of public APIs, e.g. grpc,http: the same requests "
                        "over each at each --concurrency (default 1,8), latency per request and HTTP's overhead "
                        "(uses the first of --drafts and --draft-lengths)")
    p.add_argument("--temperatures", type=_temperatures, default=(),
                   help="sampling benchmark instead: comma list of temperatures, e.g. 0,0.7,1.0: target-only, "
                        "exact-match and rejection (speculative sampling) acceptance side by side, per draft of "
                        "--drafts, at the first of --draft-lengths and adaptive")
    p.add_argument("--llama-server", nargs="?", const="auto", default="", metavar="PATH",
                   help="compare with llama.cpp's llama-server (PATH, or the one scripts/build-llama-server.sh "
                        "builds): llama-server with and without the draft, specd and specd without speculation, "
                        "at --concurrency (default 1,2,4,8,16); --drafts' first model is the draft, "
                        "--draft-lengths' first value its length")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="with --llama-server: sample at this temperature, with llama-server's default filters "
                        "(top-k 40, top-p 0.95, min-p 0.05) and a seed per prompt on both (0: greedy, outputs "
                        "compared)")
    p.add_argument("--ngram", action="append", default=[], metavar="SPEC",
                   help="with --llama-server: compare specd's n-gram drafter SPEC (one type, e.g. "
                        "mod:n-match=4:n-min=0:n-max=16) with llama-server's --spec-type of the same parameters "
                        "(repeatable)")
    p.add_argument("--requests-per-session", type=int, default=2, help="load benchmark: requests each session sends")
    p.add_argument("--min-requests", type=int, default=8, help="load benchmark: at least this many requests per cell")
    p.add_argument("--modes", type=_modes, default="target-only,fixed,adaptive",
                   help="load benchmark: comma list of the modes to run (target-only always runs: the others "
                        "are compared with it; target-only-again: a second target-only cell, the run's noise floor)")
    p.set_defaults(fn=main)


def _temperatures(text: str) -> tuple[float, ...]:
    from specd.bench_temperature import parse_temperatures

    return parse_temperatures(text)


def _protocols(text: str) -> tuple[str, ...]:
    from specd.bench_http import PROTOCOLS

    asked = tuple(p.strip() for p in text.split(",") if p.strip())
    if set(asked) - set(PROTOCOLS) or (asked and len(set(asked)) < 2):
        raise argparse.ArgumentTypeError(f"give two or more of {', '.join(PROTOCOLS)}, got {text!r}")
    return asked


def _modes(text: str) -> tuple[str, ...]:
    from specd.bench_load import KNOWN_MODES

    asked = {m.strip() for m in text.split(",") if m.strip()}
    unknown = asked - set(KNOWN_MODES)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {', '.join(sorted(unknown))}; "
                                         f"choose from {', '.join(KNOWN_MODES)}")
    return tuple(m for m in KNOWN_MODES if m in asked | {"target-only"})


def _report(out: pathlib.Path, name: str, result: dict, md: str) -> None:
    """Write a run's figures as JSON and markdown, and show the markdown."""
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    (out / f"{name}.md").write_text(md)
    print(md)
    print(f"wrote {out / (name + '.json')}, {out / (name + '.md')}")


def main(args) -> int:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.protocols:
        from specd import bench_http

        result = bench_http.bench_protocols(args)
        _report(out, "bench-protocols", result, bench_http.markdown(result))
        return 1 if result["greedy_output_mismatches"] else 0
    if args.temperatures:
        from specd import bench_temperature

        result = bench_temperature.bench_temperatures(args)
        _report(out, "bench-temperature", result, bench_temperature.markdown(result))
        return 0
    if args.llama_server:
        from specd import bench_server

        result = bench_server.bench_vs_server(args)
        _report(out, "bench-llama-server", result, bench_server.markdown(result))
        # across engines a near-tie may break either way; within specd it is for the lossless tests to judge
        return 1 if any(m["kind"] == "same engine" and m["contender"].startswith("specd")
                        for m in result["greedy_output_mismatches"]) else 0
    if args.concurrency:
        from specd import bench_load

        result = bench_load.bench_load(args)
        _report(out, "bench-load", result, bench_load.markdown(result))
        return 1 if result["greedy_output_mismatches"] else 0
    result = bench(args)
    (out / "bench.json").write_text(json.dumps(result, indent=2))
    md = markdown(result)
    (out / "bench.md").write_text(md)
    plotted = plot(result, out / "bench.png")
    print(md)
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}" + (f", {out / 'bench.png'}" if plotted else ""))
    return 1 if result["greedy_output_mismatches"] else 0
