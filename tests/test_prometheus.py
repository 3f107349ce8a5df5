"""A real Prometheus server (Debian package `prometheus`) scrapes a live
router and its workers; every query of the Grafana dashboard evaluates there
to numbers in their range."""
from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

from specd.client import RouterClient
from specd.launcher import free_port

DASHBOARD = pathlib.Path(__file__).parent.parent / "deploy" / "grafana" / "specd-dashboard.json"


# what Grafana substitutes: all namespaces (the series of this test have no
# namespace label, which ".*" matches), a rate window of a few scrapes
VARIABLES = {"$namespace": ".*", "$__rate_interval": "10s"}


def panel_exprs() -> dict[str, list[str]]:
    out = {}
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        exprs = [t["expr"] for t in p.get("targets", [])]
        for var, value in VARIABLES.items():
            exprs = [e.replace(var, value) for e in exprs]
        if exprs:
            out[p["title"]] = exprs
    return out


def query(port: int, expr: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    body = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_dashboard_acceptance_rate_on_live_prometheus(cluster_factory, tmp_path):
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed: scripts/test.sh installs Debian's `prometheus` package"
    c = cluster_factory(n_ctx=1024, n_seq=1, metrics=True)
    prom_port = free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        + "".join(f"  - job_name: specd-{role}\n    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n"
                  for role, port in c.metrics_ports.items())
    )
    log = open(tmp_path / "prometheus.log", "wb")
    prom = subprocess.Popen([binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if len([u for u in query(prom_port, "up") if u["value"][1] == "1"]) == len(c.metrics_ports):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and prom.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            time.sleep(0.5)
        with RouterClient(c.router_address) as client:
            for _ in range(3):  # traffic across several scrapes, so rate() has points to work with
                r = client.generate("1, 2, 3, 4, 5,", max_tokens=24, n_draft=4)
                assert r.n_drafted > 0
                time.sleep(1.5)
        exprs = panel_exprs()
        deadline = time.monotonic() + 30
        while not query(prom_port, exprs["Acceptance rate"][0]):
            assert time.monotonic() < deadline, "the acceptance rate stayed empty"
            time.sleep(1)
        values = {}
        for title, panel in exprs.items():
            for expr in panel:
                result = query(prom_port, expr)  # a query Prometheus refuses fails here
                assert result, f"{title}: {expr} is empty"
                values.setdefault(title, []).append([float(r["value"][1]) for r in result])
        (acceptance,), = values["Acceptance rate"]
        assert 0.3 < acceptance <= 1.0  # the default pair shares its weights: most drafts are accepted
        by_position, = values["Acceptance by position"]
        assert all(0.0 <= v <= 1.0 for v in by_position), by_position
        (per_step,), (draft_len,) = values["Tokens per target step"]
        assert 1.0 <= per_step <= 5.0 and 1.0 <= draft_len <= 4.0, (per_step, draft_len)
    finally:
        prom.terminate()
        prom.wait(30)
        log.close()
