"""A real Prometheus server (Debian package `prometheus`) scrapes a live router;
the dashboard's acceptance-rate PromQL evaluates to a number in [0, 1]."""
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


def panel_expr(title: str) -> str:
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        if p.get("title") == title:
            return p["targets"][0]["expr"]
    raise AssertionError(f"no panel {title!r} in the dashboard")


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
        f"  - job_name: specd-router\n    static_configs: [{{targets: ['127.0.0.1:{c.metrics_ports['router']}']}}]\n"
    )
    log = open(tmp_path / "prometheus.log", "wb")
    prom = subprocess.Popen([binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if query(prom_port, "up") and query(prom_port, "up")[0]["value"][1] == "1":
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
        expr = panel_expr("Acceptance rate")
        deadline = time.monotonic() + 30
        while not (result := query(prom_port, expr)):
            assert time.monotonic() < deadline, f"{expr} stayed empty"
            time.sleep(1)
        value = float(result[0]["value"][1])
        assert 0.0 <= value <= 1.0, value
        assert value > 0.3  # the default pair shares its weights: most drafts are accepted
    finally:
        prom.terminate()
        prom.wait(30)
        log.close()
