"""`specd bench --llama-server`: specd against llama.cpp's own `llama-server`,
the server a user would run instead, side by side in one run.

Contenders, all up at once (an idle server takes no CPU), on the same
prompts as the same token ids:
- llama-server: target only, as a user runs it on this machine (every core
  for generation and batches, one slot per session);
- llama-server-draft: the same with the draft model (`-md`, draft-simple);
- specd: started as `specd up` starts it (its defaults: adaptive speculation);
- specd-no-spec: the same cluster with speculation off;
- with --ngram SPEC (repeatable): llama-server with that n-gram type and
  parameters, and specd with an n-gram drafter of the same spec; and
  specd-no-spec on the first spec's cluster.

For each load C, C sessions each send their share of the requests one after
the other; aggregate tokens/s = generated tokens / wall time, prompt
processing included, prompt caches off. Every repetition runs every
contender at every load, in an order that puts each contender after each
other equally often (bench_common.balanced_order), and each contender is compared
with llama-server per repetition (the two ran close together, so drift
cancels). Greedy outputs must agree token for token with llama-server's:
a difference is reported with its request and token.
"""
from __future__ import annotations

import functools
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from specd.bench_common import (balanced_order, difference, draft_length, geomean_interval, load_prompts,
                                paired_ratios, progress, split_drafts)
from specd.models import DRAFT_FTYPE, cache_dir, resolve_draft, resolve_target

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
BASELINE = "llama-server"
BUILD_HINT = ("llama-server not found. Build it from the llama.cpp that llama-cpp-python "
              f"{LLAMA_CPP_PYTHON_VERSION} vendors (about 7 minutes on 2 cores, cached afterwards):\n"
              "    scripts/build-llama-server.sh\n"
              "or give a binary: specd bench --llama-server PATH")

# specd n-gram proposer name -> llama-server --spec-type
NGRAM_TYPES = {"simple": "ngram-simple", "map-k": "ngram-map-k", "map-k4v": "ngram-map-k4v",
               "mod": "ngram-mod", "cache": "ngram-cache"}
# llama-server's longest draft of each type (common_speculative_n_max): the
# parameter that bounds it, and its default there
NGRAM_DRAFT_BOUND = {"simple": ("size-m", 48), "map-k": ("size-m", 48), "map-k4v": ("size-m", 48),
                     "mod": ("n-max", 64), "cache": (None, 8)}


def find_llama_server(path: str) -> str:
    """An executable llama-server: PATH if given ("auto": the one
    scripts/build-llama-server.sh caches, else one on $PATH)."""
    if path and path != "auto":
        candidates = [pathlib.Path(path)]
    else:
        built = cache_dir() / f"llama-server-{LLAMA_CPP_PYTHON_VERSION}" / "build" / "bin" / "llama-server"
        on_path = shutil.which("llama-server")
        candidates = [built] + ([pathlib.Path(on_path)] if on_path else [])
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    raise SystemExit(BUILD_HINT)


def ngram_server_args(spec: str) -> tuple[list[str], int]:
    """llama-server flags for one specd n-gram spec ("mod:n-match=4:n-max=16"),
    and the draft length bound both sides use."""
    name, *params = spec.split(":")
    if name not in NGRAM_TYPES:
        raise SystemExit(f"--ngram: unknown type {name!r}; choose from {', '.join(NGRAM_TYPES)} (one type a spec)")
    args = ["--spec-type", NGRAM_TYPES[name]]
    values = {}
    for p in params:
        key, _, value = p.partition("=")
        values[key] = value
        args += [f"--spec-{NGRAM_TYPES[name]}-{key}", value]
    key, default = NGRAM_DRAFT_BOUND[name]
    return args, (int(values.get(key) or default) if key else default)


@dataclass
class Answer:
    tokens: list[int]
    drafted: int = 0  # draft tokens the target verified
    accepted: int = 0  # of those, the ones it kept


class LlamaServer:
    """One llama-server process on a free port; /completion with token ids."""

    def __init__(self, binary: str, model: str, n_seq: int, n_ctx: int, threads: int, extra: list[str],
                 workdir: pathlib.Path, name: str):
        from specd.launcher import free_port  # loads gRPC: not at CLI start

        self.port = free_port()
        self.log_path = workdir / f"{name}.log"
        cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
               "-tb", str(threads), "-np", str(n_seq), "-c", str(n_seq * n_ctx), "--no-webui", *extra]
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not start: see {self.log_path}\n"
                                   + self.log_path.read_text(errors="replace")[-2000:])
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def generate(self, ids: list[int], max_tokens: int, temperature: float = 0.0) -> Answer:
        body = {"prompt": ids, "n_predict": max_tokens, "temperature": temperature, "cache_prompt": False,
                "return_tokens": True, "stream": False}
        if temperature > 0:
            body.update(SAMPLED_FILTERS, seed=request_seed(ids))
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=1800) as r:
            out = json.loads(r.read())
        timings = out.get("timings", {})
        # llama-server lists the end-of-generation token it stopped at; specd does not
        return Answer(out["tokens"][:-1] if out.get("stop_type") == "eos" else out["tokens"],
                      timings.get("draft_n", 0), timings.get("draft_n_accepted", 0))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# Sampled runs (--temperature): llama-server's default filters, sent to both
# servers so that both sample the same distributions.
SAMPLED_FILTERS = {"top_k": 40, "top_p": 0.95, "min_p": 0.05}


def request_seed(ids: list[int]) -> int:
    """A request's seed: its prompt's, the same in every contender and repetition."""
    return zlib.crc32(b",".join(str(t).encode() for t in ids))


@dataclass
class Contender:
    name: str
    generate: Callable[[list[int], int], Answer]


def specd_generate(address: str, temperature: float = 0.0, **kwargs) -> Callable[[list[int], int], Answer]:
    from specd.client import RouterClient  # gRPC and the protos: not at CLI start
    from specd.v1 import router_pb2 as rpb

    client = RouterClient(address, timeout=1800)

    def generate(ids: list[int], max_tokens: int) -> Answer:
        sampling = rpb.SamplingParams(temperature=temperature, seed=request_seed(ids),
                                      **(SAMPLED_FILTERS if temperature > 0 else {}))
        r = client.generate(ids, max_tokens=max_tokens, sampling=sampling, **kwargs)
        return Answer(r.tokens, r.n_drafted, r.n_accepted)

    return generate


def run_cell(contender: Contender, prompts: list[list[int]], sessions: int, max_tokens: int) -> dict:
    shares = [list(range(len(prompts)))[i::sessions] for i in range(sessions)]
    out: list[Answer] = [Answer([]) for _ in prompts]

    def session(share):
        for i in share:
            out[i] = contender.generate(prompts[i], max_tokens)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(sessions) as pool:
        list(pool.map(session, shares))
    wall = time.perf_counter() - t0
    generated = sum(len(a.tokens) for a in out)
    return {"tok_s": generated / wall, "wall": wall, "generated": generated, "tokens": [a.tokens for a in out],
            "drafted": sum(a.drafted for a in out), "accepted": sum(a.accepted for a in out)}


@dataclass
class Setup:
    """Everything started for a run; closed at the end."""

    contenders: list[Contender] = field(default_factory=list)
    servers: list[LlamaServer] = field(default_factory=list)
    clusters: list = field(default_factory=list)

    def close(self) -> None:
        for s in self.servers:
            s.stop()
        for c in self.clusters:
            c.stop()


def start_all(args, levels: list[int], workdir: pathlib.Path) -> Setup:
    from specd.launcher import Cluster, ClusterSpec, default_threads  # loads gRPC: not at CLI start

    binary = find_llama_server(args.llama_server)
    target = resolve_target(args.target)
    draft, _ = resolve_draft(next((d for d in split_drafts(args.drafts) if not d.startswith("ngram:")),
                             DRAFT_FTYPE.lower()))
    n_draft = draft_length(args)
    n_seq, cores = max(levels), os.cpu_count() or 2
    threads = default_threads()
    setup = Setup()

    def server(name: str, extra: list[str]) -> None:
        s = LlamaServer(binary, target, n_seq, args.n_ctx, cores, extra, workdir, name)
        setup.servers.append(s)
        setup.contenders.append(Contender(name, functools.partial(s.generate, temperature=args.temperature)))

    def cluster(ngram: str = "", router_args: list[str] = ()) -> str:
        spec = ClusterSpec(target_model=target, draft_model="" if ngram else draft, ngram=ngram,
                           target_threads=threads.target, target_threads_batch=threads.target_batch,
                           draft_threads=threads.draft, draft_threads_batch=threads.draft_batch,
                           n_ctx=args.n_ctx, n_seq=n_seq, router_args=["--no-prompt-cache", *router_args])
        c = Cluster(spec).start()
        setup.clusters.append(c)
        return c.router_address

    try:
        server(BASELINE, [])
        if not args.ngram:
            server("llama-server-draft", ["-md", draft, "--spec-type", "draft-simple",
                                          "--spec-draft-n-max", str(n_draft)])
            address = cluster(router_args=["--n-max", str(n_draft)])
            setup.contenders.append(Contender("specd", specd_generate(address, args.temperature)))
            setup.contenders.append(Contender(SPECD_PLAIN, specd_generate(address, args.temperature, speculative=False)))
        for i, spec in enumerate(args.ngram):
            extra, n_max = ngram_server_args(spec)
            server(f"llama-server {spec}", [*extra, "--spec-draft-n-max", str(n_max)])
            address = cluster(ngram=spec, router_args=["--n-max", str(n_max)])
            setup.contenders.append(Contender(f"specd {spec}", specd_generate(address, args.temperature)))
            if i == 0:  # specd's plain path on the same prompts: what the n-gram contenders start from
                setup.contenders.append(Contender(SPECD_PLAIN, specd_generate(address, args.temperature,
                                                                              speculative=False)))
    except BaseException:
        setup.close()
        raise
    return setup


def bench_vs_server(args) -> dict:
    from specd.client import RouterClient  # loads gRPC: not at CLI start

    levels = [int(x) for x in args.concurrency.split(",")] if args.concurrency else [1, 2, 4, 8, 16]
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="specd-bench-server-"))
    setup = start_all(args, levels, workdir)
    try:
        with RouterClient(setup.clusters[0].router_address) as c:
            texts = load_prompts(args.workload, args.prompts)
            ids = [c.tokenize(t) for t in texts]
        names = [x.name for x in setup.contenders]
        cells: dict[tuple[int, str], list[dict]] = {}
        mismatches = []
        bar = progress(total=args.repeats * len(levels) * len(names), desc="specd bench (vs llama-server)", unit="cell")
        for rep in range(args.repeats):
            for c in levels:
                n_req = max(args.requests_per_session * c, args.min_requests)
                prompts = [ids[i % len(ids)] for i in range(n_req)]
                outputs = {}
                for x in balanced_order(setup.contenders, rep + levels.index(c)):
                    cell = run_cell(x, prompts, c, args.max_tokens)
                    cells.setdefault((c, x.name), []).append(cell)
                    outputs[x.name] = cell["tokens"]
                    bar.update(1)
                    bar.set_postfix_str(f"C={c} {x.name}: {cell['tok_s']:.1f} tok/s")
                if args.temperature == 0:  # sampled outputs differ by design
                    mismatches += [{"repetition": rep, "sessions": c, **d} for d in compare_outputs(outputs)]
        bar.close()
    finally:
        setup.close()
    return {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {"concurrency": levels, "contenders": names, "workload": args.workload, "max_tokens": args.max_tokens,
                     "requests_per_session": args.requests_per_session, "min_requests": args.min_requests,
                     "repeats": args.repeats, "n_ctx": args.n_ctx, "target": args.target, "drafts": args.drafts,
                     "draft_lengths": args.draft_lengths, "ngram": args.ngram, "temperature": args.temperature,
                     "greedy": args.temperature == 0, "prompt_cache": False, "llama_server": find_llama_server(args.llama_server)},
        "rows": rows(cells, levels, names),
        "greedy_output_mismatches": mismatches,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


SPECD_PLAIN = "specd-no-spec"


def compare_outputs(outputs: dict[str, list[list[int]]]) -> list[dict]:
    """Greedy differences in one cell. Each speculative contender is compared
    with its own engine without speculation ("same engine": what lossless
    promises), and specd's plain path with llama-server's ("across engines":
    two builds of llama.cpp whose float sums may break a near-tie the other
    way); without a plain specd contender (--ngram runs) specd's runs are
    compared across engines. Each difference names its request and first
    differing token."""
    pairs = [(SPECD_PLAIN, BASELINE, "across engines")]
    for name in outputs:
        if name in (BASELINE, SPECD_PLAIN):
            continue
        if name.startswith("llama-server"):
            pairs.append((name, BASELINE, "same engine"))
        else:  # without a plain specd contender (--ngram runs), against llama-server
            pairs.append((name, *((SPECD_PLAIN, "same engine") if SPECD_PLAIN in outputs else (BASELINE, "across engines"))))
    found = []
    for name, ref, kind in pairs:
        if name not in outputs or ref not in outputs or outputs[name] == outputs[ref]:
            continue
        found.append({"kind": kind, "contender": name, "against": ref, **difference(outputs[ref], outputs[name])})
    return found


def rows(cells: dict[tuple[int, str], list[dict]], levels: list[int], names: list[str]) -> list[dict]:
    out = []
    for c in levels:
        base = [r["tok_s"] for r in cells[(c, BASELINE)]]
        for name in names:
            runs = [r["tok_s"] for r in cells[(c, name)]]
            mean, lo, hi = geomean_interval(paired_ratios(runs, base))
            out.append({"concurrency": c, "contender": name, "tok_s_median": statistics.median(runs),
                        "tok_s_min": min(runs), "tok_s_max": max(runs), "tok_s_runs": runs,
                        "vs_llama_server": {"geomean": mean, "ci90": [lo, hi]},
                        "drafted": sum(r["drafted"] for r in cells[(c, name)]),
                        "accepted": sum(r["accepted"] for r in cells[(c, name)])})
    return out


def sampled(temperature: float) -> str:
    if temperature == 0:
        return "greedy"
    return (f"sampled at temperature {temperature:g} with top-k {SAMPLED_FILTERS['top_k']}, top-p "
            f"{SAMPLED_FILTERS['top_p']}, min-p {SAMPLED_FILTERS['min_p']} (llama-server's defaults) and a seed per "
            "prompt on both (outputs not compared)")


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = ["| sessions | contender | aggregate tok/s median (min–max) | × llama-server per repetition: geo-mean "
             "[90% CI] | draft tokens accepted / verified |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        v = r["vs_llama_server"]
        drafts = f"{r['accepted']} / {r['drafted']}" if r.get("drafted") else "–"
        lines.append(f"| {r['concurrency']} | {r['contender']} | {r['tok_s_median']:.1f} ({r['tok_s_min']:.1f}–"
                     f"{r['tok_s_max']:.1f}) | {v['geomean']:.2f} [{v['ci90'][0]:.2f}–{v['ci90'][1]:.2f}] | {drafts} |")
    lines += ["", f"Machine: {result['machine']['cpus']} CPUs. Workload {s['workload']}, {s['max_tokens']} tokens a "
              f"request, {s['requests_per_session']} requests a session (at least {s['min_requests']} a cell), "
              f"{sampled(s.get('temperature', 0.0))}, "
              f"prompt caches off, {s['repeats']} repetitions, contenders in an order balanced for what ran "
              "before (Williams). llama-server: "
              f"`-t N -tb N -np {max(s['concurrency'])} -c {max(s['concurrency'])}×{s['n_ctx']}` (N = all cores); "
              "specd as `specd up` starts it."
              + ("" if s.get("temperature", 0.0) else
                 f" Greedy output differences: {len(result['greedy_output_mismatches'])} (same engine: a speculative "
                 "contender against its own engine without speculation; across engines: specd's plain path against "
                 "llama-server).")]
    for m in result["greedy_output_mismatches"]:
        lines.append(f"- {m['kind']}, repetition {m['repetition']}, {m['sessions']} sessions: {m['contender']} differs from "
                     f"{m['against']} at request {m['request']}, token {m['position']} "
                     f"(expected {m['expected']}, got {m['got']})")
    return "\n".join(lines) + "\n"
