"""Record what llama.cpp's own n-gram map drafter proposes, for specd's port to match.

Builds ngram_map_driver.cpp against the static libraries of the llama-server
build (scripts/build-llama-server.sh: the llama.cpp that llama-cpp-python
0.3.36 vendors), plays copy-heavy synthetic generations through it step by
step (draft, then accept as many tokens as the true continuation holds),
and writes each trace with llama.cpp's drafts to tests/data/ngram_map_llama.json.
tests/test_ngram_parity.py replays the traces through specd's map-k / map-k4v.

    .venv/bin/python scripts/ngram_parity/ngram_parity.py          # rebuild the file
    .venv/bin/python scripts/ngram_parity/ngram_parity.py --check  # compare only
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
OUT = REPO / "tests" / "data" / "ngram_map_llama.json"
sys.path.insert(0, str(REPO))
from tests.test_ngram_parity import play  # noqa: E402  the steps the test replays, one definition

LIBS = ["common/libllama-common.a", "common/libllama-common-base.a", "src/libllama.a",
        "ggml/src/libggml.a", "ggml/src/libggml-cpu.a", "ggml/src/libggml-base.a"]

# (name, size_n, size_m, key_only, min_hits, seed): llama.cpp's defaults and small keys
CONFIGS = [
    ("map-k default", 12, 48, True, 1, 1),
    ("map-k4v default", 12, 48, False, 1, 2),
    ("map-k n3 m8", 3, 8, True, 1, 3),
    ("map-k4v n3 m8", 3, 8, False, 1, 4),
    ("map-k4v n2 m4 min-hits 2", 2, 4, False, 2, 5),
    ("map-k4v n1 m3", 1, 3, False, 1, 6),
]


def server_root() -> Path:
    out = subprocess.run(["bash", str(REPO / "scripts" / "build-llama-server.sh")],
                         check=True, capture_output=True, text=True).stdout.split()[-1]
    return Path(out).parents[2]   # <root>/build/bin/llama-server


def build_driver(root: Path) -> Path:
    exe = root / "build" / "ngram_map_driver"
    src = root / "src"
    cmd = ["g++", "-O1", "-std=c++17", f"-I{src}/common", f"-I{src}/include", f"-I{src}/ggml/include",
           str(HERE / "ngram_map_driver.cpp"), "-o", str(exe)]
    cmd += [str(root / "build" / lib) for lib in LIBS] + ["-fopenmp", "-lpthread"]
    subprocess.run(cmd, check=True)
    return exe


def copy_heavy(rng: np.random.Generator, n_prompt: int, n_gen: int) -> tuple[list[int], int]:
    """A prompt of recurring phrases, then a continuation that copies spans
    of it with edits: keys recur with one or several continuations."""
    vocab = rng.choice(50_000, size=400, replace=False)
    phrases = [vocab[rng.integers(0, 400, size=rng.integers(3, 20))].tolist() for _ in range(30)]
    prompt: list[int] = []
    while len(prompt) < n_prompt:
        prompt += phrases[rng.integers(0, 30)]
    return copy_heavy_after(rng, prompt, n_gen, phrases)


def copy_heavy_after(rng: np.random.Generator, prompt: list[int], n_gen: int,
                     phrases: list[list[int]] | None = None) -> tuple[list[int], int]:
    """`prompt` and n_gen tokens after it: copied spans, its phrases, new tokens."""
    tokens = list(prompt)
    while len(tokens) < len(prompt) + n_gen:
        r = rng.random()
        if r < 0.6 or not phrases:   # copy a span of what came before
            a = int(rng.integers(0, len(tokens) - 8))
            tokens += tokens[a : a + int(rng.integers(8, 80))]
        elif r < 0.85:               # a known phrase
            tokens += phrases[rng.integers(0, len(phrases))]
        else:                        # a few new tokens
            tokens += rng.integers(50_000, 60_000, size=rng.integers(1, 4)).tolist()
    return tokens[: len(prompt) + n_gen], len(prompt)


def run_llama(exe: Path, trace: dict) -> list[list[int]]:
    """The drafts llama.cpp's common_ngram_map makes over the trace's turns."""
    args = [str(trace["size_n"]), str(trace["size_m"]), str(int(trace["key_only"])), str(trace["min_hits"])]
    proc = subprocess.Popen([str(exe), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def send(line: str) -> None:
        proc.stdin.write(line + "\n")

    def draft_after(tokens: list[int], pos: int) -> list[int]:
        inp = tokens[: pos - 1]
        send(f"D {len(inp)} {' '.join(map(str, inp))} {tokens[pos - 1]}")
        proc.stdin.flush()
        return [int(t) for t in proc.stdout.readline().split()[1:]]

    drafts: list[list[int]] = []
    for turn in trace["turns"]:
        tokens, begin = turn["tokens"], turn["begin"]
        send(f"B {begin} {' '.join(map(str, tokens[:begin]))}")
        drafts += play(tokens, begin, lambda pos: draft_after(tokens, pos), lambda k: send(f"A {k}"))
    proc.stdin.close()
    proc.wait()
    return drafts


def traces() -> list[dict]:
    """Per configuration three turns of one conversation: a first answer; the
    next turn's prompt holding all of it; then one that rewrites the end of
    the first answer (a shorter prompt: llama.cpp forgets what it indexed there)."""
    out = []
    for name, n, m, key_only, min_hits, seed in CONFIGS:
        rng = np.random.default_rng(seed)
        first, p1 = copy_heavy(rng, 700, 600)
        second, _ = copy_heavy_after(rng, first, 300)
        third, _ = copy_heavy_after(rng, first[: p1 + 200] + rng.integers(60_000, 61_000, 20).tolist(), 400)
        turns = [{"tokens": first, "begin": p1}, {"tokens": second, "begin": len(first)},
                 {"tokens": third, "begin": p1 + 220}]
        out.append({"name": name, "size_n": n, "size_m": m, "key_only": key_only, "min_hits": min_hits,
                    "turns": turns})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the stored file, write nothing")
    args = ap.parse_args()
    exe = build_driver(server_root())
    recorded = []
    for trace in traces():
        trace["drafts"] = run_llama(exe, trace)
        recorded.append(trace)
        n_tok = sum(len(d) for d in trace["drafts"])
        print(f"{trace['name']}: {len(trace['drafts'])} steps, {n_tok} draft tokens", file=sys.stderr)
    if args.check:
        same = json.loads(OUT.read_text())["traces"] == recorded
        print("same as the stored file" if same else "DIFFERS from the stored file")
        return 0 if same else 1
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"source": "llama.cpp common/ngram-map.cpp as vendored by llama-cpp-python 0.3.36",
                               "made_by": "scripts/ngram_parity/ngram_parity.py", "traces": recorded}) + "\n")
    print(f"wrote {os.path.relpath(OUT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
