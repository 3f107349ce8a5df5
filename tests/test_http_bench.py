"""`specd bench --protocols grpc,http` end to end on a tiny setting: both
protocols run the same requests, the table reports HTTP's overhead, and the
greedy outputs agree."""
from __future__ import annotations

import json
import subprocess
import sys


def test_protocol_bench_smoke(tmp_path, models):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "specd", "bench", "--protocols", "grpc,http", "--concurrency", "1,2", "--drafts", "q4_1",
         "--draft-lengths", "2", "--prompts", "2", "--max-tokens", "4", "--repeats", "1", "--min-requests", "2",
         "--n-ctx", "512", "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((out / "bench-protocols.json").read_text())
    rows = {(r["concurrency"], r["protocol"]): r for r in result["rows"]}
    assert set(rows) == {(1, "grpc"), (1, "http"), (2, "grpc"), (2, "http")}
    assert all(r["requests"] == 4 if c == 2 else r["requests"] == 2 for (c, _), r in rows.items())
    assert rows[(1, "grpc")]["minus_grpc_ms_median"] == 0
    assert result["greedy_output_mismatches"] == []
    assert "| 2 | http |" in (out / "bench-protocols.md").read_text()
