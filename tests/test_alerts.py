"""The PrometheusRule's alerts (deploy/k8s/base/monitoring.yaml) under
promtool: valid rules, and expressions that fire on what they are for and
stay quiet on what a client causes."""
from __future__ import annotations

import shutil
import subprocess

import yaml

from tests.test_deploy import objects

# series as a scraped cell shows them (the PodMonitor's labels)
CELL = 'namespace="specd", app_kubernetes_io_instance="specd", pod="specd-cell-0"'


def _promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is not installed: scripts/test.sh installs Debian's `prometheus` package"
    return path


def _groups() -> list[dict]:
    (rule,) = objects("base", "PrometheusRule").values()
    return rule["spec"]["groups"]


def _expr(alert: str) -> str:
    return next(r["expr"] for g in _groups() for r in g["rules"] if r.get("alert") == alert)


def _fires(tmp_path, alert: str, series: list[dict], at: str, fires: bool) -> None:
    """Whether the alert's expression has a result at `at` given `series`."""
    expr = _expr(alert).strip()
    test = {"interval": "1m", "input_series": series,
            "promql_expr_test": [{"expr": f"count({expr}) > 0", "eval_time": at,
                                  "exp_samples": [{"labels": "{}", "value": 1}] if fires else []}]}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m",
                                                          "tests": [test]}))
    r = subprocess.run([_promtool(), "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, f"{alert} {'should' if fires else 'should not'} fire:\n{r.stdout}{r.stderr}"


def _requests(outcome: str, per_minute: int) -> dict:
    return {"series": f'specd_requests_total{{{CELL}, outcome="{outcome}", protocol="grpc"}}',
            "values": f"0+{per_minute}x40"}


def _up(job: str, value: int = 1) -> dict:
    return {"series": f'up{{{CELL}, job="{job}"}}', "values": f"{value}+0x40"}


def test_alert_rules_are_valid(tmp_path):
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": _groups()}))
    r = subprocess.run([_promtool(), "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_server_errors_page_and_client_outcomes_do_not(tmp_path):
    client_caused = [_requests("ok", 60), _requests("cancelled", 30), _requests("invalid_argument", 30),
                     _requests("resource_exhausted", 30)]
    _fires(tmp_path, "SpecdHighErrorRate", client_caused, "30m", fires=False)
    _fires(tmp_path, "SpecdHighErrorRate", [_requests("ok", 60), _requests("unavailable", 30)], "30m", fires=True)
    _fires(tmp_path, "SpecdHighErrorRate", [_requests("ok", 60), _requests("error", 30)], "30m", fires=True)


def test_a_router_down_or_not_scraped_at_all_pages(tmp_path):
    workers = [_up("specd-target"), _up("specd-draft")]
    _fires(tmp_path, "SpecdScrapeTargetDown", [_up("specd-router"), *workers], "10m", fires=False)
    _fires(tmp_path, "SpecdScrapeTargetDown", [_up("specd-router", 0), *workers], "10m", fires=True)
    _fires(tmp_path, "SpecdScrapeTargetDown", workers, "10m", fires=True)  # no router series at all
