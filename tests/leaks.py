"""Leak checks against real processes: what each worker holds, the router's
gauges, and a process's resident memory."""
from __future__ import annotations

import re
import time
import urllib.request

import grpc

from specd.worker.v1 import worker_pb2 as wpb
from specd.worker.v1 import worker_pb2_grpc as wpb_grpc

WORKERS = ("target", "draft")


def scrape(port: int) -> dict[str, float]:
    """Unlabelled samples of a /metrics endpoint, by name."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^([a-zA-Z_:][\w:]*) (\S+)$", text, re.M)}


def worker_address(cluster, role: str) -> str:
    return f"127.0.0.1:{int(cluster.procs[role].port_file.read_text())}"


def held(cluster, role: str) -> dict[int, int]:
    """seq_id -> tokens held, for every sequence of the worker that holds any
    (from the worker's own GetSeqState, i.e. llama.cpp's memory for a model)."""
    with grpc.insecure_channel(worker_address(cluster, role)) as ch:
        stub = wpb_grpc.WorkerStub(ch)
        n_seq = stub.GetModelInfo(wpb.GetModelInfoRequest(), timeout=10).n_seq
        out = {}
        for i in range(n_seq):
            s = stub.GetSeqState(wpb.GetSeqStateRequest(seq_id=i), timeout=10)
            if s.n_tokens or s.pos_max != -1 or s.pos_min != -1:
                out[i] = s.n_tokens
        return out


def snapshot(cluster) -> dict:
    """What both workers hold and what the router's gauges say (needs
    metrics=True on the cluster)."""
    ports = cluster.metrics_ports
    out = {"router": scrape(ports["router"])}
    for role in WORKERS:
        if role in cluster.procs:
            m = scrape(ports[role]) if role in ports else {}
            out[role] = {"held": held(cluster, role), "sequences_in_use": m.get("specd_worker_sequences_in_use"),
                         "kv_cells_used": m.get("specd_worker_kv_cells_used")}
    return out


def leaks(snap: dict) -> list[str]:
    """What `snap` shows beyond what the router's prompt cache accounts for:
    no session running or queued; the target holds exactly the tokens the
    prompt-cache gauge counts and the draft at most that (a prefix of each
    cached history); nothing is held for a sequence the router does not
    cache. With --no-prompt-cache that means nothing at all."""
    r = snap["router"]
    problems = []
    if r.get("specd_sessions_running", 0) != 0:
        problems.append(f"router: {r['specd_sessions_running']:g} sessions still running")
    if r.get("specd_sessions_queued", 0) != 0:
        problems.append(f"router: {r['specd_sessions_queued']:g} sessions still queued")
    cached = r.get("specd_prompt_cache_tokens", 0)
    t = snap["target"]
    if sum(t["held"].values()) != cached or t["kv_cells_used"] not in (None, cached):
        problems.append(f"target holds {t['held']} ({t['kv_cells_used']} cells), the prompt cache {cached:g} tokens")
    if t["sequences_in_use"] not in (None, len(t["held"])):
        problems.append(f"target: {t['sequences_in_use']} sequences in use, {len(t['held'])} hold tokens")
    if "draft" in snap:
        d = snap["draft"]
        if sum(d["held"].values()) > cached or d["kv_cells_used"] not in (None, sum(d["held"].values())):
            problems.append(f"draft holds {d['held']} ({d['kv_cells_used']} cells), the prompt cache {cached:g} tokens")
        if set(d["held"]) - set(t["held"]):
            problems.append(f"draft holds sequences {sorted(set(d['held']) - set(t['held']))} the target does not")
        for i, n in d["held"].items():
            if n > t["held"].get(i, 0):
                problems.append(f"draft seq {i} holds {n} tokens, more than the target's {t['held'].get(i, 0)}")
    return problems


def wait_no_leaks(cluster, timeout: float = 20.0) -> dict:
    """Poll until nothing leaks (releases finish asynchronously); return the
    last snapshot or fail with what leaked."""
    deadline = time.monotonic() + timeout
    while True:
        snap = snapshot(cluster)
        problems = leaks(snap)
        if not problems:
            return snap
        assert time.monotonic() < deadline, "leaked: " + "; ".join(problems)
        time.sleep(0.25)


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS in /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def rss(cluster) -> dict[str, int]:
    return {role: rss_bytes(cluster.procs[role].popen.pid) for role in WORKERS + ("router",) if role in cluster.procs}
