"""`specd bench`: its flags and which benchmark a run is.

By default the draft sweep of one session at a time (specd.bench_single:
target-only, in-process and distributed side by side); --concurrency the
load benchmark (bench_load), --protocols gRPC beside HTTP (bench_http),
--temperatures sampled decoding (bench_temperature), --llama-server a
comparison with llama.cpp's server (bench_server). They share
specd.bench_common and import nothing from here.

Every `specd` command imports this module to build its parser, so none of
these modules imports gRPC, the router or llama.cpp at the top: each mode
imports them inside the function that needs them.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib

from specd import bench_http, bench_load, bench_server, bench_single, bench_temperature
from specd.bench_http import PROTOCOLS
from specd.bench_load import KNOWN_MODES
from specd.bench_temperature import parse_temperatures
from specd.models import DRAFT_FTYPE


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark target-only, in-process and distributed speculative decoding")
    p.add_argument("--target", default="smollm2", help="smollm2 | gemma3 | NAME:FTYPE (e.g. gemma3:F32, derived) | PATH")
    p.add_argument("--drafts", default=f"{DRAFT_FTYPE.lower()},q2_k",
                   help="comma list: q8_0, q4_1, q2_k, f16 (derived from the shipped model; "
                        f"{DRAFT_FTYPE.lower()} is the default draft), ngram:SPEC or a path")
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
                   help="target threads while the draft does not compute (default: all cores, as `specd up`)")
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
    return parse_temperatures(text)


def _protocols(text: str) -> tuple[str, ...]:
    asked = tuple(p.strip() for p in text.split(",") if p.strip())
    if set(asked) - set(PROTOCOLS) or (asked and len(set(asked)) < 2):
        raise argparse.ArgumentTypeError(f"give two or more of {', '.join(PROTOCOLS)}, got {text!r}")
    return asked


def _modes(text: str) -> tuple[str, ...]:
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
        result = bench_http.bench_protocols(args)
        _report(out, "bench-protocols", result, bench_http.markdown(result))
        return 1 if result["greedy_output_mismatches"] else 0
    if args.temperatures:
        result = bench_temperature.bench_temperatures(args)
        _report(out, "bench-temperature", result, bench_temperature.markdown(result))
        return 0
    if args.llama_server:
        result = bench_server.bench_vs_server(args)
        _report(out, "bench-llama-server", result, bench_server.markdown(result))
        # across engines a near-tie may break either way; within specd it is for the lossless tests to judge
        return 1 if any(m["kind"] == "same engine" and m["contender"].startswith("specd")
                        for m in result["greedy_output_mismatches"]) else 0
    if args.concurrency:
        result = bench_load.bench_load(args)
        _report(out, "bench-load", result, bench_load.markdown(result))
        return 1 if result["greedy_output_mismatches"] else 0
    result = bench_single.bench(args)
    (out / "bench.json").write_text(json.dumps(result, indent=2))
    md = bench_single.markdown(result)
    (out / "bench.md").write_text(md)
    plotted = bench_single.plot(result, out / "bench.png")
    print(md)
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}" + (f", {out / 'bench.png'}" if plotted else ""))
    return 1 if result["greedy_output_mismatches"] else 0
