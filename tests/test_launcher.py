"""The processes `specd up` / `specd demo` / `specd bench` start do not
outlive them: a launcher stopped with SIGTERM stops them, one killed with
SIGKILL takes them down too (they get SIGTERM when their parent dies)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from specd.launcher import free_port


def children(pid: int) -> set[int]:
    """Processes whose parent is `pid`, from /proc."""
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[1]) == pid:
            out.add(int(entry))
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(predicate, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def start_up(models, tmp_path, *command) -> tuple[subprocess.Popen, set[int]]:
    log = open(tmp_path / "launcher.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "specd", *command, "--target-model", models["target"],
                             "--draft-model", models["draft"], "--n-ctx", "256", "--n-seq", "1"],
                            stdout=log, stderr=subprocess.STDOUT)
    # all three started (target, draft, router): the router is the last
    assert wait_for(lambda: len(children(proc.pid)) == 3 or proc.poll() is not None, 120), \
        (tmp_path / "launcher.log").read_text()
    assert proc.poll() is None, (tmp_path / "launcher.log").read_text()
    return proc, children(proc.pid)


def test_workers_die_with_a_launcher_killed_by_sigkill(models, tmp_path):
    proc, kids = start_up(models, tmp_path, "up", "--port", str(free_port()))
    proc.kill()
    proc.wait(10)
    assert wait_for(lambda: not any(alive(p) for p in kids), 30), [p for p in kids if alive(p)]


def test_sigterm_to_a_launcher_stops_its_workers(models, tmp_path):
    # `specd demo` had no SIGTERM handler: it died at once and left target,
    # draft and router running
    proc, kids = start_up(models, tmp_path, "demo", "The capital of France is", "--max-tokens", "256")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM
    assert not any(alive(p) for p in kids), [p for p in kids if alive(p)]
