"""Issue #24 end to end: target and draft started at the same moment (as
Kubernetes starts pods) time their decodes beside each other; adaptive
speculation must still draft on every start, whatever their calibrations
say. Real processes, real models."""
from __future__ import annotations

from specd.client import RouterClient
from specd.launcher import Cluster, ClusterSpec

STARTS = 3
COUNTING = "1, 2, 3, 4, 5,"  # a long, predictable answer: drafting pays here whenever it is tried


def _calibration(cluster: Cluster) -> str:
    return "\n".join(line for name in ("target", "draft") for line in cluster.procs[name].log_path.read_text().splitlines()
                     if " cost" in line)


def test_every_fresh_start_drafts(models):
    drafted = []
    for _ in range(STARTS):
        spec = ClusterSpec(target_model=models["target"], draft_model=models["draft"], n_ctx=256, n_seq=1,
                           start_together=True, router_args=["--adaptive"])
        with Cluster(spec) as cluster:
            with RouterClient(cluster.router_address) as client:
                out = client.generate(COUNTING, max_tokens=64, adaptive=True)
            drafted.append(out.n_drafted)
            assert out.n_drafted > 0, f"start {len(drafted)} never drafted:\n{_calibration(cluster)}"
    assert len(drafted) == STARTS
