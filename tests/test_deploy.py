"""Checks of the deployment artefacts: deploy/k8s (kustomize), docker/, deploy/grafana.

What runs here:
  * `kubectl kustomize` renders the base, every overlay, and the autoscaling
    components (prometheus-adapter, keda) on top of the cpu overlay;
  * every rendered object is validated against the Kubernetes JSON schemas with
    kubernetes-validate (strict: unknown fields are errors), for the oldest and
    the newest Kubernetes version we support; the CRDs it has no schema for
    (PodMonitor, PrometheusRule, KEDA's ScaledObject) are checked field by
    field here instead;
  * checkov scans the rendered manifests and the Dockerfiles; any failed check
    not in CHECKOV_ALLOW_LIST (each entry with its reason) fails the test;
  * structural rules of our own. specd runs as cells: one Deployment whose pod
    holds the router and its own target and draft, the router calling them on
    127.0.0.1. The rules: gRPC startup/readiness/liveness probes per
    container, requests = limits (Guaranteed QoS), thread counts equal to CPU
    requests, security context, model delivery, GPU placement, one metrics
    port per container, the instance label in every selector (two installs
    in one namespace never select each other's pods), the HPA on the routers'
    queue with at least two cells, a PDB of one cell at a time, network
    policy, alerts, dashboard.

The tools (checkov, kubernetes-validate) live in their own virtualenv,
$REPO/.venv-tools, installed by `bash .ci/install-deploy-tools`; kubectl comes
from the machine. A missing tool fails the test: it is never skipped.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
TOOLS_BIN = REPO / ".venv-tools" / "bin"
DASHBOARD = REPO / "deploy" / "grafana" / "specd-dashboard.json"
DOCKERFILES = [REPO / "docker" / "Dockerfile.cpu", REPO / "docker" / "Dockerfile.gpu"]
INSTALL_HINT = "install the deploy tools with: bash .ci/install-deploy-tools"

# The kustomizations in the repository.
KUSTOMIZATIONS = {
    "base": K8S / "base",
    "cpu": K8S / "overlays" / "cpu",
    "gpu": K8S / "overlays" / "gpu",
    "cpu-pvc": K8S / "overlays" / "cpu-pvc",
    "cpu-b": K8S / "overlays" / "cpu-b",
}
# A second install of the cpu overlay in the same namespace: its name suffix
# and instance label.
NAME_SUFFIX = {"cpu-b": "-b"}
INSTANCE = {"cpu-b": "specd-b"}
DEFAULT_INSTANCE = "specd"

# Components no overlay of the repository uses, rendered on top of the cpu
# overlay by a kustomization written to a temporary directory (name: the
# overlay, the components).
COMPOSED = {
    "cpu+adapter": ("cpu", ["prometheus-adapter"]),
    "cpu+keda": ("cpu", ["keda"]),
}

# Kubernetes versions the manifests must be valid for: 1.30 is the oldest we
# support (the preStop `sleep` action is on by default from 1.30, native gRPC
# probes from 1.27); 1.37 is the newest schema kubernetes-validate 1.37 ships,
# which catches removed or renamed fields.
K8S_VERSIONS = ["1.30.0", "1.37.0"]

# Kinds kubernetes-validate has no schema for; each is checked explicitly below.
CRD_KINDS = {"PodMonitor", "PrometheusRule", "ScaledObject"}

# checkov checks that are allowed to fail, with the reason. Nothing else may
# fail, and an entry that no longer fails anywhere must be removed (see
# test_checkov_allow_list_is_not_stale), so this list cannot silently rot.
CHECKOV_ALLOW_LIST = {
    # "Image should use digest": the manifests pin immutable release tags
    # (ghcr.io/specd/specd:0.1.0, never `latest`). The digest only exists once
    # CI has pushed the image, so the release step sets it with
    # `kustomize edit set image ghcr.io/specd/specd@sha256:...` (see the
    # overlays' `images:`); a digest committed here would be a made-up one.
    "CKV_K8S_43": "release tags pinned; digests are set at release time",
    # "Image Pull Policy should be Always": with immutable tags the cached image
    # is the right one, and IfNotPresent spares every restart of the
    # multi-GB CUDA target a registry round trip and keeps a registry outage
    # from blocking a restart. (The check's concern, cached private images being
    # used without pull credentials in shared clusters, is the job of the
    # AlwaysPullImages admission plugin where it matters.)
    "CKV_K8S_15": "IfNotPresent is correct for immutable tags",
    # "HEALTHCHECK instruction": Kubernetes ignores Docker HEALTHCHECKs; the
    # manifests use native gRPC probes against grpc.health.v1, which a Docker
    # HEALTHCHECK could only imitate with an extra probe binary in the image.
    "CKV_DOCKER_2": "Kubernetes gRPC probes replace HEALTHCHECK",
}

# Metrics and what the manifests/alerts/dashboard must reference.
# The dashboard's acceptance-rate query, up to label matchers (e.g. a
# $namespace filter) and range windows ([1m], [$__rate_interval]): see
# _query_shape.
ACCEPTANCE_RATE_SHAPE = (
    "sum(rate(specd_spec_decode_num_accepted_tokens_total[w]))"
    " / sum(rate(specd_spec_decode_num_draft_tokens_total[w]))"
)
ROLES = ("router", "target", "draft")
WORKERS = ("target", "draft")
GRPC_PORTS = {"router": 50051, "target": 50061, "draft": 50062}
ROUTER_HTTP_PORT = 8080
# One metrics port per container: the three share the pod's network namespace.
METRICS_PORTS = {"router": 9090, "target": 9091, "draft": 9092}
INSTANCE_LABEL = "app.kubernetes.io/instance"
# The router's sessions gauges, which the cells scale on.
QUEUED = "specd_sessions_queued"
RUNNING = "specd_sessions_running"


# --------------------------------------------------------------------------
# tools


def _tool(name: str) -> str:
    path = TOOLS_BIN / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(f"deploy tool {name!r} not found at {path} (tools venv missing or broken); {INSTALL_HINT}",
                    pytrace=False)
    return str(path)


def _kubectl() -> str:
    path = shutil.which("kubectl")
    if not path:
        pytest.fail(
            "kubectl not found on PATH (needed for `kubectl kustomize`); "
            "install kubectl >= 1.27 (it has kustomize built in)",
            pytrace=False,
        )
    return path


def _run(cmd: list[str], timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired:
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}", pytrace=False)


# --------------------------------------------------------------------------
# rendering


_composed_root: list[Path] = []


def kustomization_dir(name: str) -> Path:
    if name in KUSTOMIZATIONS:
        return KUSTOMIZATIONS[name]
    overlay, components = COMPOSED[name]
    if not _composed_root:
        root = Path(tempfile.mkdtemp(prefix="specd-kustomize-"))
        atexit.register(shutil.rmtree, root, True)
        _composed_root.append(root)
    d = _composed_root[0] / name.replace("+", "-")
    d.mkdir(exist_ok=True)
    # kustomize refuses absolute paths; relative ones may leave the root
    rel = lambda p: os.path.relpath(p, d)  # noqa: E731
    text = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        # objects a component adds get no namespace from the overlay below
        "namespace": "specd",
        "resources": [rel(KUSTOMIZATIONS[overlay])],
        "components": [rel(K8S / "components" / c) for c in components],
    }
    (d / "kustomization.yaml").write_text(json.dumps(text))  # JSON is YAML
    return d


@functools.lru_cache(maxsize=None)
def render_text(name: str) -> str:
    proc = _run([_kubectl(), "kustomize", str(kustomization_dir(name))])
    if proc.returncode != 0:
        pytest.fail(f"kubectl kustomize {name} failed:\n{proc.stderr}", pytrace=False)
    return proc.stdout


@functools.lru_cache(maxsize=None)
def _yaml_json(text: str) -> str:
    # YAML -> JSON with the tools venv's PyYAML (a dependency of both tools), so
    # this test needs nothing beyond pytest in the project's own venv.
    proc = _run(
        [_tool("python"), "-c",
         "import json, sys, yaml; "
         "json.dump([d for d in yaml.safe_load_all(sys.stdin) if d is not None], sys.stdout)"],
        input=text,
    )
    if proc.returncode != 0:
        pytest.fail(f"not valid YAML:\n{proc.stderr}", pytrace=False)
    return proc.stdout


def load_yaml(text: str) -> list:
    return json.loads(_yaml_json(text))  # fresh copy: tests may not mutate the cache


def render(name: str) -> list[dict]:
    return load_yaml(render_text(name))


def objects(name: str, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in render(name) if o["kind"] == kind}


def sfx(name: str) -> str:
    return NAME_SUFFIX.get(name, "")


def instance(name: str) -> str:
    return INSTANCE.get(name, DEFAULT_INSTANCE)


def cell(name: str) -> dict:
    deps = objects(name, "Deployment")
    assert list(deps) == [f"specd-cell{sfx(name)}"], f"{name}: expected the one Deployment specd-cell, found {list(deps)}"
    return deps[f"specd-cell{sfx(name)}"]


def pod_spec(name: str) -> dict:
    return cell(name)["spec"]["template"]["spec"]


def pod_labels(name: str) -> dict:
    return cell(name)["spec"]["template"]["metadata"]["labels"]


def container(name: str, role: str) -> dict:
    found = [c for c in pod_spec(name)["containers"] if c["name"] == role]
    assert len(found) == 1, f"{name}: expected one container {role!r} in the cell"
    return found[0]


def init_container(name: str, role: str) -> dict:
    found = [c for c in pod_spec(name).get("initContainers", []) if c["name"] == f"models-{role}"]
    assert len(found) == 1, f"{name}: expected one init container models-{role}"
    return found[0]


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def container_config(name: str, c: dict) -> dict[str, str]:
    """The environment a container gets: envFrom ConfigMaps, then env."""
    cms = {n: o.get("data", {}) for n, o in objects(name, "ConfigMap").items()}
    merged: dict[str, str] = {}
    for src in c.get("envFrom", []):
        ref = src["configMapRef"]["name"]
        assert ref in cms, f"{name}: {c['name']} references missing ConfigMap {ref}"
        merged.update(cms[ref])
    merged.update({k: v for k, v in env_of(c).items() if v is not None})
    return merged


def config(name: str, role: str) -> dict[str, str]:
    return container_config(name, container(name, role))


def cpu_cores(quantity: str) -> float:
    q = str(quantity)
    return int(q[:-1]) / 1000 if q.endswith("m") else float(q)


def all_containers(name: str) -> list[dict]:
    spec = pod_spec(name)
    return spec.get("initContainers", []) + spec["containers"]


def startup_budget(c: dict) -> int:
    p = c["startupProbe"]
    return p.get("periodSeconds", 10) * p.get("failureThreshold", 3)


ALL = list(KUSTOMIZATIONS)
RENDERED = ALL + list(COMPOSED)


# --------------------------------------------------------------------------
# rendering + schema validation


@pytest.mark.parametrize("name", ALL)
def test_kustomization_renders_expected_objects(name):
    s = sfx(name)
    kinds = {(o["kind"], re.sub(r"-[a-z0-9]{10}$", "", o["metadata"]["name"]) if o["kind"] == "ConfigMap"
              else o["metadata"]["name"]) for o in render(name)}
    expected = {
        ("ServiceAccount", f"specd{s}"),
        ("ConfigMap", f"specd-common{s}"), ("ConfigMap", f"specd-router{s}"),
        ("ConfigMap", f"specd-target{s}"), ("ConfigMap", f"specd-draft{s}"),
        ("Deployment", f"specd-cell{s}"), ("Service", f"specd-router{s}"),
        ("PodDisruptionBudget", f"specd-cell{s}"), ("HorizontalPodAutoscaler", f"specd-cell{s}"),
        ("NetworkPolicy", f"specd-default-deny-ingress{s}"), ("NetworkPolicy", f"specd-router-from-clients{s}"),
        ("NetworkPolicy", f"specd-metrics-from-prometheus{s}"),
        ("PodMonitor", f"specd{s}"), ("PrometheusRule", f"specd{s}"),
    }
    # the namespace belongs to the first install only (overlays/cpu-b)
    if name not in NAME_SUFFIX:
        expected.add(("Namespace", "specd"))
    missing = expected - kinds
    assert not missing, f"{name}: missing objects {sorted(missing)}"
    # One Deployment (the cell) and one Service (the public API): no worker
    # Deployments or Services a router could be pointed at by mistake.
    assert len(objects(name, "Deployment")) == 1 and len(objects(name, "Service")) == 1, \
        f"{name}: expected one Deployment and one Service"
    for o in render(name):
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == "specd", f"{name}: {o['kind']}/{o['metadata']['name']} not in namespace specd"


@pytest.mark.parametrize("name", RENDERED)
def test_kubernetes_schema_validation(name, tmp_path):
    docs = render(name)
    files = {}
    for i, doc in enumerate(docs):
        f = tmp_path / f"{i:03d}-{doc['kind']}-{doc['metadata']['name']}.json"
        f.write_text(json.dumps(doc))  # JSON is YAML: kubernetes-validate reads it
        files[f.name] = doc
    cmd = [_tool("kubernetes-validate"), "--strict"]
    for v in K8S_VERSIONS:
        cmd += ["-k", v]
    proc = _run(cmd + [str(tmp_path / n) for n in sorted(files)])
    out, rc = proc.stdout + proc.stderr, proc.returncode
    problems = [line for line in out.splitlines() if not line.startswith(("INFO", "WARN"))]
    assert rc == 0 and not problems, f"{name}: schema validation failed (exit {rc}):\n" + "\n".join(problems)

    for fname, doc in files.items():
        lines = [line for line in out.splitlines() if fname in line]
        if doc["kind"] in CRD_KINDS:
            # No schema bundled: must be reported as such (never "passed"), and
            # is then covered by the tests of that kind below.
            assert lines and all(line.startswith("WARN") and "Couldn't find schema" in line for line in lines), \
                f"{name}: unexpected kubernetes-validate result for {fname}:\n" + "\n".join(lines)
        else:
            passed = [line for line in lines if line.startswith("INFO") and " passed " in line]
            assert len(passed) == len(K8S_VERSIONS), (
                f"{name}: {fname} was not validated against every version {K8S_VERSIONS} "
                f"(a kind without schema is not allowed outside {sorted(CRD_KINDS)}):\n" + "\n".join(lines))


# --------------------------------------------------------------------------
# CRDs kubernetes-validate cannot check


def _selector_matches(selector: dict, labels: dict) -> bool:
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for expr in selector.get("matchExpressions", []):
        val = labels.get(expr["key"])
        op = expr["operator"]
        if op == "In":
            ok &= val in expr["values"]
        elif op == "NotIn":
            ok &= val not in expr["values"]
        elif op == "Exists":
            ok &= expr["key"] in labels
        elif op == "DoesNotExist":
            ok &= expr["key"] not in labels
        else:
            raise AssertionError(f"unknown selector operator {op}")
    return ok


def _promql_balanced(expr: str) -> bool:
    stack, pairs = [], {")": "(", "]": "[", "}": "{"}
    in_str = None
    for ch in expr:
        if in_str:
            if ch == in_str:
                in_str = None
            continue
        if ch in "\"'":
            in_str = ch
        elif ch in "([{":
            stack.append(ch)
        elif ch in pairs:
            if not stack or stack.pop() != pairs[ch]:
                return False
    return not stack and in_str is None


@pytest.mark.parametrize("name", ALL)
def test_podmonitor(name):
    pms = objects(name, "PodMonitor")
    assert list(pms) == [f"specd{sfx(name)}"], f"{name}: expected one PodMonitor"
    pm = next(iter(pms.values()))
    # Required by the CRD: apiVersion/kind/metadata.name, spec.selector; and
    # endpoints, without which nothing is scraped.
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    spec = pm["spec"]
    assert isinstance(spec.get("selector"), dict) and spec["selector"].get("matchLabels"), "PodMonitor needs spec.selector"
    # It selects this install's cells, and only by the cell's labels.
    assert _selector_matches(spec["selector"], pod_labels(name))
    assert spec["selector"]["matchLabels"].get(INSTANCE_LABEL) == instance(name), \
        f"{name}: the PodMonitor must select by {INSTANCE_LABEL}={instance(name)}"
    # The instance label on every series: the alerts group by it.
    assert INSTANCE_LABEL in spec.get("podTargetLabels", [])
    endpoints = spec.get("podMetricsEndpoints")
    assert isinstance(endpoints, list) and endpoints, "PodMonitor needs spec.podMetricsEndpoints"
    scraped = {}
    for ep in endpoints:
        assert ep.get("path", "/metrics") == "/metrics"
        assert re.fullmatch(r"\d+s", ep.get("interval", "")), f"endpoint interval missing/invalid: {ep}"
        assert int(ep["scrapeTimeout"][:-1]) <= int(ep["interval"][:-1])
        # role and job set per endpoint: the metrics carry no role, and the
        # dashboard and SpecdScrapeTargetDown group by job = specd-<role>
        relabel = {r.get("targetLabel"): r for r in ep.get("relabelings", [])}
        role = relabel.get("role", {}).get("replacement")
        assert role in ROLES, f"endpoint {ep.get('port')} must set a role label: {ep}"
        assert relabel.get("job", {}).get("replacement") == f"specd-{role}"
        assert not relabel["role"].get("sourceLabels") and relabel["role"].get("action", "replace") == "replace"
        scraped[role] = ep["port"]
    assert set(scraped) == set(ROLES), f"{name}: PodMonitor scrapes {sorted(scraped)}, not every container"
    # Each endpoint is the named metrics port of its own container.
    for role, port_name in scraped.items():
        ports = {p["name"]: p["containerPort"] for p in container(name, role)["ports"]}
        assert ports.get(port_name) == METRICS_PORTS[role], f"{name}: {role}'s metrics port is not {port_name}"


@pytest.mark.parametrize("name", ALL)
def test_prometheusrule(name):
    rules = objects(name, "PrometheusRule")
    assert list(rules) == [f"specd{sfx(name)}"], f"{name}: expected one PrometheusRule"
    pr = next(iter(rules.values()))
    assert pr["apiVersion"] == "monitoring.coreos.com/v1"
    groups = pr["spec"].get("groups")
    assert isinstance(groups, list) and groups, "PrometheusRule needs spec.groups"
    alerts = {}
    for g in groups:
        assert isinstance(g.get("name"), str) and g["name"], f"group without name: {g}"
        assert isinstance(g.get("rules"), list) and g["rules"], f"group {g['name']} without rules"
        for r in g["rules"]:
            # Each rule: exactly one of alert/record, and an expr.
            assert ("alert" in r) != ("record" in r), f"rule needs exactly one of alert/record: {r}"
            assert isinstance(r.get("expr"), str) and r["expr"].strip(), f"rule without expr: {r}"
            assert _promql_balanced(r["expr"]), f"unbalanced PromQL in {r.get('alert') or r.get('record')}"
            if "alert" in r:
                assert re.fullmatch(r"\d+[smh]", r.get("for", "")), f"alert {r['alert']} needs a `for` duration"
                assert r.get("labels", {}).get("severity") in {"warning", "critical"}, \
                    f"alert {r['alert']} needs severity warning|critical"
                assert r.get("annotations", {}).get("summary"), f"alert {r['alert']} needs a summary"
                alerts[r["alert"]] = " ".join(r["expr"].split())

    acc = alerts.get("SpecdAcceptanceRateCollapsed", "")
    assert "rate(specd_spec_decode_num_accepted_tokens_total" in acc
    assert "rate(specd_spec_decode_num_draft_tokens_total" in acc
    assert acc.index("specd_spec_decode_num_accepted_tokens_total") < acc.index("specd_spec_decode_num_draft_tokens_total")
    assert "specd_draft_worker_up" in alerts.get("SpecdDraftWorkerDown", "")
    assert "== 0" in alerts["SpecdDraftWorkerDown"]
    # what the error-rate and scrape alerts fire on: tests/test_alerts.py (promtool)
    assert "specd_requests_total{outcome!~" in alerts.get("SpecdHighErrorRate", "")
    # The scrape alert matches the jobs the PodMonitor sets.
    down = alerts.get("SpecdScrapeTargetDown", "")
    m = re.search(r'up\{job=~"([^"]+)"\}', down)
    assert m and all(re.fullmatch(m.group(1), f"specd-{role}") for role in ROLES), down
    # A queue that outlasts the autoscaler (no adapter, maxReplicas, Pending cells).
    assert QUEUED in alerts.get("SpecdSessionsQueuedSustained", "")
    # Label names the alerts group by exist on the series: the PodMonitor's
    # podTargetLabels turn app.kubernetes.io/instance into this one.
    for expr in alerts.values():
        for label in re.findall(r"by \(([^)]*)\)", expr):
            for lab in (x.strip() for x in label.split(",")):
                assert lab in {"namespace", "pod", "app_kubernetes_io_instance", "outcome"}, f"groups by unknown label {lab}"


# --------------------------------------------------------------------------
# checkov


@pytest.fixture(scope="session")
def checkov_report(tmp_path_factory) -> dict:
    """One checkov run over every rendering and both Dockerfiles."""
    checkov = _tool("checkov")
    scan = tmp_path_factory.mktemp("checkov")
    for name in RENDERED:
        (scan / f"{name}.yaml").write_text(render_text(name))
    for df in DOCKERFILES:
        shutil.copy(df, scan / df.name)
    env = dict(os.environ,
               # Offline and deterministic: no update check against PyPI, no
               # download of platform guidelines/policies.
               CKV_SKIP_PACKAGE_UPDATE_CHECK="true", BC_SKIP_MAPPING="TRUE")
    env.pop("BC_API_KEY", None)
    proc = _run([checkov, "-d", str(scan), "--framework", "kubernetes", "dockerfile",
                 "--skip-download", "-o", "json"], env=env)
    # Exit 1 just means "some check failed"; the JSON tells which.
    if proc.returncode not in (0, 1):
        pytest.fail(f"checkov crashed (exit {proc.returncode}):\n{proc.stderr[-4000:]}", pytrace=False)
    try:
        data = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"checkov printed no JSON report:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}", pytrace=False)
    reports = data if isinstance(data, list) else [data]
    by_type = {r["check_type"]: r for r in reports}
    assert set(by_type) == {"kubernetes", "dockerfile"}, f"checkov scanned {sorted(by_type)}"
    for t, r in by_type.items():
        s = r["summary"]
        assert s["parsing_errors"] == 0, f"checkov could not parse some {t} files: {s}"
        assert s["passed"] > 50, f"checkov ran suspiciously few {t} checks: {s}"
    return by_type


def _failures(report: dict, filename: str) -> list[dict]:
    return [c for c in report["results"].get("failed_checks", [])
            if Path(c["file_path"]).name == filename]


@pytest.mark.parametrize("name", RENDERED)
def test_checkov_kubernetes(name, checkov_report):
    report = checkov_report["kubernetes"]
    passed = [c for c in report["results"].get("passed_checks", [])
              if Path(c["file_path"]).name == f"{name}.yaml"]
    assert passed, f"checkov evaluated nothing in {name}.yaml"
    # Suppressions must live in CHECKOV_ALLOW_LIST, not in manifest annotations.
    skipped = [c for c in report["results"].get("skipped_checks", [])
               if Path(c["file_path"]).name == f"{name}.yaml"]
    assert not skipped, f"{name}: inline checkov suppressions found: {[(c['check_id'], c['resource']) for c in skipped]}"
    bad = [f"{c['check_id']} {c['check_name']} -> {c['resource']}"
           for c in _failures(report, f"{name}.yaml") if c["check_id"] not in CHECKOV_ALLOW_LIST]
    assert not bad, f"{name}: checkov failures not in the allow-list:\n" + "\n".join(bad)


@pytest.mark.parametrize("dockerfile", [d.name for d in DOCKERFILES])
def test_checkov_dockerfile(dockerfile, checkov_report):
    report = checkov_report["dockerfile"]
    bad = [f"{c['check_id']} {c['check_name']} -> {c['resource']}"
           for c in _failures(report, dockerfile) if c["check_id"] not in CHECKOV_ALLOW_LIST]
    assert not bad, f"{dockerfile}: checkov failures not in the allow-list:\n" + "\n".join(bad)


def test_checkov_allow_list_is_not_stale(checkov_report):
    failed_ids = {c["check_id"] for r in checkov_report.values() for c in r["results"].get("failed_checks", [])}
    stale = set(CHECKOV_ALLOW_LIST) - failed_ids
    assert not stale, f"allow-listed checkov checks no longer fail; remove them: {sorted(stale)}"
    for check_id, reason in CHECKOV_ALLOW_LIST.items():
        assert reason.strip(), f"{check_id} needs a reason"


# --------------------------------------------------------------------------
# the cell: one pod, router + target + draft


@pytest.mark.parametrize("name", ALL)
def test_the_cell_is_one_pod_of_router_target_and_draft(name):
    spec = pod_spec(name)
    assert sorted(c["name"] for c in spec["containers"]) == sorted(ROLES)
    assert sorted(c["name"] for c in spec.get("initContainers", [])) == ["models-draft", "models-target"]
    # `kubectl logs` without -c reads the router
    annotations = cell(name)["spec"]["template"]["metadata"].get("annotations", {})
    assert annotations.get("kubectl.kubernetes.io/default-container") == "router"


@pytest.mark.parametrize("name", ALL)
def test_router_reaches_its_own_workers_over_loopback(name):
    """A router clears every sequence of a worker it attaches to: it must
    only ever reach the workers of its own pod."""
    router = config(name, "router")
    for role, key in (("target", "SPECD_TARGET"), ("draft", "SPECD_DRAFT")):
        host, port = router[key].rsplit(":", 1)
        assert host in {"127.0.0.1", "localhost", "[::1]"}, f"{name}: {key}={router[key]} leaves the pod"
        worker = config(name, role)
        assert int(port) == int(worker["SPECD_PORT"]) == GRPC_PORTS[role], f"{name}: {key} port != {role}'s SPECD_PORT"
        # the worker listens where the router dials (and where probes reach it)
        assert worker["SPECD_HOST"] in {"0.0.0.0", "::"}, f"{name}: {role} SPECD_HOST={worker['SPECD_HOST']}"
        ports = {p["containerPort"] for p in container(name, role)["ports"]}
        assert int(port) in ports, f"{name}: {role} does not declare port {port}"
    assert int(router["SPECD_PORT"]) == GRPC_PORTS["router"]
    assert int(router["SPECD_HTTP_PORT"]) == ROUTER_HTTP_PORT
    # Workers that share sessions must agree on sequences and context.
    t, d = config(name, "target"), config(name, "draft")
    assert t["SPECD_N_SEQ"] == d["SPECD_N_SEQ"] and t["SPECD_N_CTX"] == d["SPECD_N_CTX"]


@pytest.mark.parametrize("name", ALL)
def test_the_service_reaches_only_the_routers_api(name):
    svcs = objects(name, "Service")
    svc = svcs[f"specd-router{sfx(name)}"]
    assert svc["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert _selector_matches({"matchLabels": svc["spec"]["selector"]}, pod_labels(name))
    router_ports = {p["name"]: p["containerPort"] for p in container(name, "router")["ports"]}
    targets = set()
    for p in svc["spec"]["ports"]:
        tp = p["targetPort"]
        targets.add(router_ports[tp] if isinstance(tp, str) else tp)
    assert targets == {GRPC_PORTS["router"], ROUTER_HTTP_PORT}, f"{name}: the Service exposes {sorted(targets)}"


@pytest.mark.parametrize("name", ALL)
def test_each_container_has_its_own_metrics_port(name):
    declared = [p["containerPort"] for c in pod_spec(name)["containers"] for p in c.get("ports", [])]
    assert len(declared) == len(set(declared)), f"{name}: two containers declare one port: {declared}"
    names = [p["name"] for c in pod_spec(name)["containers"] for p in c.get("ports", [])]
    assert len(names) == len(set(names)), f"{name}: port names must be unique in the pod: {names}"
    for role in ROLES:
        port = int(config(name, role)["SPECD_METRICS_PORT"])
        assert port == METRICS_PORTS[role], f"{name}: {role} SPECD_METRICS_PORT {port}"
        assert port in {p["containerPort"] for p in container(name, role)["ports"]}
    # and none is another container's serving port (all seven ports distinct)
    assert len(set(METRICS_PORTS.values()) | set(GRPC_PORTS.values()) | {ROUTER_HTTP_PORT}) == 7


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("role", ROLES)
def test_container_grpc_probes(name, role):
    c = container(name, role)
    assert GRPC_PORTS[role] in {p["containerPort"] for p in c["ports"]}, f"{role}: no gRPC port {GRPC_PORTS[role]}"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = c.get(probe)
        assert p, f"{name}/{role}: no {probe}"
        assert set(p) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, f"{name}/{role}: {probe} must be a native gRPC probe"
        # each container on its own port: a probe on another's would restart
        # the wrong process
        assert p["grpc"]["port"] == GRPC_PORTS[role], f"{name}/{role}: {probe} probes the wrong port"
        # startup and readiness follow whether the process can serve (service
        # ""); liveness asks only whether it is alive, which stays SERVING while
        # loading and draining, so a draining pod is not killed early
        want = "liveness" if probe == "livenessProbe" else None
        assert p["grpc"].get("service") == want, f"{name}/{role}: {probe} asks for service {p['grpc'].get('service')}"
    budget = startup_budget(c)
    assert budget >= 120, f"{name}/{role}: startup budget {budget}s is too short for model loading"


@pytest.mark.parametrize("name", ALL)
def test_the_drain_window_covers_the_worst_case_request(name):
    """A rollout must not cut an admitted request: the router bounds every
    request (tokens and time), every container drains at least that long, and
    the workers outlive their router's last stream."""
    router = config(name, "router")
    assert int(router["SPECD_MAX_TOKENS_LIMIT"]) > 0
    timeout = float(router["SPECD_REQUEST_TIMEOUT"])
    assert timeout > 0
    tgps = pod_spec(name)["terminationGracePeriodSeconds"]
    pre = {}
    for role in ROLES:
        c = container(name, role)
        grace = float(config(name, role)["SPECD_GRACE_SECONDS"])
        assert grace >= timeout, f"{name}/{role}: grace {grace}s < request timeout {timeout}s"
        pre[role] = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert tgps >= grace + pre[role], f"{name}/{role}: terminationGracePeriodSeconds < preStop {pre[role]}s + grace {grace}s"
    for role in WORKERS:
        assert pre[role] > pre["router"], f"{name}: {role} gets SIGTERM no later than the router it serves"


@pytest.mark.parametrize("name", ALL)
def test_router_waits_at_least_as_long_as_target_loads(name):
    # The router is NOT_SERVING until its target answers, so its startup
    # budget must cover the target's, or it restart-loops during a slow load.
    r, t = startup_budget(container(name, "router")), startup_budget(container(name, "target"))
    assert r >= t, f"{name}: router startup {r}s < target {t}s"


@pytest.mark.parametrize("name", ALL)
def test_resources_make_the_cell_guaranteed(name):
    # Guaranteed QoS for the whole pod (exclusive cores for the decode threads
    # under the static CPU manager) needs requests == limits for CPU and
    # memory on every container, init containers and the router included.
    for c in all_containers(name):
        res = c.get("resources", {})
        for kind in ("requests", "limits"):
            for r in ("cpu", "memory"):
                assert r in res.get(kind, {}), f"{name}/{c['name']}: no {kind}.{r}"
        for r in ("cpu", "memory"):
            assert res["limits"][r] == res["requests"][r], f"{name}/{c['name']}: {r} limit != request"


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("role", ROLES)
def test_thread_counts_match_cpu_requests(name, role):
    c = container(name, role)
    env = env_of(c)
    cpu = cpu_cores(c["resources"]["requests"]["cpu"])
    assert cpu == int(cpu) and cpu >= 1, f"{name}/{role}: CPU request must be whole cores, is {cpu}"
    # Set explicitly as literals in the container, next to the resources.
    assert env.get("OMP_NUM_THREADS") is not None, f"{name}/{role}: OMP_NUM_THREADS not set explicitly"
    assert int(env["OMP_NUM_THREADS"]) == int(cpu), f"{name}/{role}: OMP_NUM_THREADS {env['OMP_NUM_THREADS']} != CPU request {cpu}"
    if role in WORKERS:
        assert env.get("SPECD_THREADS") is not None, f"{name}/{role}: SPECD_THREADS not set explicitly"
        assert int(env["SPECD_THREADS"]) == int(cpu), f"{name}/{role}: SPECD_THREADS {env['SPECD_THREADS']} != CPU request {cpu}"
        assert int(env["SPECD_THREADS"]) == int(cpu_cores(c["resources"]["limits"]["cpu"]))


@pytest.mark.parametrize("name", ALL)
def test_cell_security(name):
    pod = pod_spec(name)
    psc = pod["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] >= 10000
    assert psc["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == f"specd{sfx(name)}"
    assert pod["enableServiceLinks"] is False, "injected SPECD_*_PORT variables could clobber settings"
    for c in all_containers(name):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc.get("privileged", False) is False
        assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add")
        image = c["image"]
        repo, _, tag = image.rpartition(":")
        assert "@sha256:" in image or (repo and tag and tag != "latest" and "/" not in tag), \
            f"{name}/{c['name']}: image {image} is not pinned"
        # a read-only root fs needs a writable /tmp in every container
        writable = {m["mountPath"] for m in c.get("volumeMounts", []) if not m.get("readOnly")}
        assert "/tmp" in writable, f"{name}/{c['name']}: no writable /tmp"
    # every volume is bounded or read-only
    for v in pod["volumes"]:
        if "emptyDir" in v:
            assert v["emptyDir"].get("sizeLimit"), f"{name}: emptyDir {v['name']} without sizeLimit"


API_KEYS_SECRET = "specd-api-keys"


def _secret_file(name: str, role: str, var: str) -> tuple[str, str]:
    """(Secret, key in it) of the file `var` names, checking that it is a
    read-only mount of a required Secret no other user can read."""
    c = container(name, role)
    path = container_config(name, c).get(var)
    assert path, f"{name}/{role}: {var} is not set"
    volumes = {v["name"]: v for v in pod_spec(name)["volumes"]}
    for m in c.get("volumeMounts", []):
        mount = m["mountPath"].rstrip("/") + "/"
        if path.startswith(mount):
            secret = volumes[m["name"]].get("secret")
            assert secret, f"{name}/{role}: {var}={path} is on volume {m['name']}, not a Secret"
            assert m.get("readOnly") is True, f"{name}/{role}: the key mount must be read-only"
            # a missing Secret must keep the pod from starting, not let it serve without keys
            assert not secret.get("optional"), f"{name}/{role}: the key Secret must not be optional"
            assert secret.get("defaultMode", 0o644) & 0o007 == 0, f"{name}/{role}: keys readable by others"
            key = path[len(mount):]
            items = {i["path"]: i["key"] for i in secret.get("items", [])}
            return secret["secretName"], items.get(key, key)
    raise AssertionError(f"{name}/{role}: {var}={path} is not on any mounted volume")


@pytest.mark.parametrize("name", ALL)
def test_workers_require_the_routers_api_key(name):
    # Item 7 of #18: a worker must refuse callers without a key, and the
    # router must present one the workers hold. The workers listen on the pod
    # IP (for probes and metrics), so the key is what stops a pod that slips
    # past the NetworkPolicy.
    router = _secret_file(name, "router", "SPECD_WORKER_API_KEY_FILE")
    assert router[0] == API_KEYS_SECRET
    for role in WORKERS:
        assert _secret_file(name, role, "SPECD_API_KEY_FILE") == router, \
            f"{name}: {role} reads its keys from another file than the one the router presents"
        # health stays open, so the probes (test_container_grpc_probes) need no key


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("role", WORKERS)
def test_worker_model_delivery(name, role):
    pod = pod_spec(name)
    init = init_container(name, role)
    argv = init["command"] + init.get("args", [])
    # the user's model at the path is kept; only an empty slot is filled, and
    # only with --default (issue #23)
    assert argv[:4] == ["specd", "models", "--link", f"/models/{role}.gguf"] and argv[4:6] == ["--role", role], argv
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "models" in volumes
    mounts = {m["name"]: m for m in init["volumeMounts"]}
    assert mounts["models"]["mountPath"] == "/models"
    claim = volumes["models"].get("persistentVolumeClaim")
    if claim:  # a pre-populated claim: read-only, never filled with the demo model
        assert "--default" not in argv and mounts["models"].get("readOnly") is True and claim.get("readOnly") is True
        pvc = objects(name, "PersistentVolumeClaim")[claim["claimName"]]
        # every cell mounts it (two at least, on different nodes, plus a surge cell)
        assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
    else:
        assert "--default" in argv and not mounts["models"].get("readOnly")
    c = container(name, role)
    cmounts = {m["name"]: m for m in c["volumeMounts"]}
    assert cmounts["models"]["mountPath"] == "/models" and cmounts["models"].get("readOnly") is True
    assert config(name, role)["SPECD_MODEL"] == f"/models/{role}.gguf"
    assert container_config(name, init)["SPECD_CACHE_DIR"].startswith("/models/")
    # The init container uses the CPU image everywhere (no GPU for it).
    assert "cuda" not in init["image"]
    # The scheduler reserves the disk the emptyDir may fill.
    if "emptyDir" in volumes["models"]:
        assert volumes["models"]["emptyDir"]["sizeLimit"] == init["resources"]["requests"]["ephemeral-storage"]
    # The router never sees the models.
    assert "models" not in {m["name"] for m in container(name, "router").get("volumeMounts", [])}


def test_gpu_overlay_puts_the_workers_on_gpus():
    pod = pod_spec("gpu")
    t = container("gpu", "target")
    assert t["resources"]["limits"].get("nvidia.com/gpu") == 1
    assert t["resources"]["requests"].get("nvidia.com/gpu") == 1
    assert "cuda" in t["image"], f"GPU target must use the CUDA image, not {t['image']}"
    assert any(x.get("key") == "nvidia.com/gpu" and x.get("effect") == "NoSchedule" for x in pod.get("tolerations", []))
    assert pod.get("nodeSelector", {}).get("nvidia.com/gpu.present") == "true", "GPU cell needs a GPU nodeSelector"
    assert int(config("gpu", "target")["SPECD_N_GPU_LAYERS"]) > 0
    # A CPU model draft cannot keep up with a GPU target: the draft is on a
    # GPU too (or model-free), the router on CPU.
    d = container("gpu", "draft")
    assert config("gpu", "draft").get("SPECD_NGRAM") or (
        d["resources"]["limits"].get("nvidia.com/gpu") == 1 and "cuda" in d["image"]
        and int(config("gpu", "draft")["SPECD_N_GPU_LAYERS"]) > 0)
    router = container("gpu", "router")
    assert "nvidia.com/gpu" not in router["resources"]["limits"] and "cuda" not in router["image"]
    # No spare GPUs for a surge cell: one cell at a time is replaced while the
    # others serve (never Recreate: that would stop every cell at once).
    assert cell("gpu")["spec"]["strategy"] == {"type": "RollingUpdate",
                                               "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


@pytest.mark.parametrize("name", ALL)
def test_pods_run_on_the_architecture_of_their_images(name):
    assert pod_spec(name).get("nodeSelector", {}).get("kubernetes.io/arch") == "amd64", name


@pytest.mark.parametrize("name", ["base", "cpu", "cpu-pvc", "cpu-b"])
def test_cpu_renderings_use_no_gpu(name):
    for c in all_containers(name):
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
        assert "cuda" not in c["image"]
    for role in WORKERS:
        assert int(config(name, role)["SPECD_N_GPU_LAYERS"]) == 0
    assert not pod_spec(name).get("tolerations")
    # CPU: a new cell loads before an old one stops
    assert cell(name)["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


# --------------------------------------------------------------------------
# scaling, disruption, isolation between installs


def _pods_metric(hpa: dict, metric: str) -> dict | None:
    for m in hpa["spec"].get("metrics", []):
        if m["type"] == "Pods" and m["pods"]["metric"]["name"] == metric:
            return m["pods"]["target"]
    return None


@pytest.mark.parametrize("name", ALL)
def test_hpa_scales_cells_on_the_routers_queue(name):
    hpas = objects(name, "HorizontalPodAutoscaler")
    assert list(hpas) == [f"specd-cell{sfx(name)}"]
    hpa = next(iter(hpas.values()))
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"specd-cell{sfx(name)}"}
    # two cells at least: a drain, an eviction or a rollout never takes the last
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    assert "replicas" not in cell(name)["spec"], "the HPA owns the cell count"
    queued = _pods_metric(hpa, QUEUED)
    assert queued and queued["type"] == "AverageValue" and 0 < float(queued["averageValue"]), \
        f"{name}: the HPA must scale on the Pods metric {QUEUED}"
    # Only the routers' sessions gauges: CPU says nothing about busy-waiting workers.
    for m in hpa["spec"]["metrics"]:
        assert m["type"] == "Pods" and m["pods"]["metric"]["name"] in {QUEUED, RUNNING}, m
    running = _pods_metric(hpa, RUNNING)
    if running:
        # a utilisation target below a cell's capacity (SPECD_N_SEQ sequences)
        n_seq = int(config(name, "target")["SPECD_N_SEQ"])
        assert 0 < float(running["averageValue"]) < n_seq, f"{name}: {RUNNING} target must be below SPECD_N_SEQ {n_seq}"
    # scale down one cell at a time (each drains its streams and must reload
    # two models to come back), after a stabilisation window
    down = hpa["spec"]["behavior"]["scaleDown"]
    assert down["stabilizationWindowSeconds"] >= 300
    assert all(p["type"] == "Pods" and p["value"] == 1 for p in down["policies"])


@pytest.mark.parametrize("name", ALL)
def test_pdb_takes_one_cell_at_a_time(name):
    pdbs = objects(name, "PodDisruptionBudget")
    assert list(pdbs) == [f"specd-cell{sfx(name)}"]
    pdb = next(iter(pdbs.values()))["spec"]
    assert _selector_matches(pdb["selector"], pod_labels(name)), "the PDB selects no cell"
    assert pdb.get("maxUnavailable") == 1 and "minAvailable" not in pdb
    assert pdb.get("unhealthyPodEvictionPolicy") == "AlwaysAllow"
    # one at a time is only safe with more than one
    hpa = next(iter(objects(name, "HorizontalPodAutoscaler").values()))
    assert hpa["spec"]["minReplicas"] >= 2
    # neither a rollout nor a drain ever takes every cell
    ru = cell(name)["spec"]["strategy"].get("rollingUpdate", {})
    assert cell(name)["spec"]["strategy"]["type"] == "RollingUpdate" and ru.get("maxUnavailable", 0) < hpa["spec"]["minReplicas"]


def _selectors(name: str) -> list[tuple[str, dict]]:
    """Every label selector of a rendering that picks pods, with where it is."""
    out = []
    dep = cell(name)
    out.append(("Deployment", dep["spec"]["selector"]))
    for t in dep["spec"]["template"]["spec"].get("topologySpreadConstraints", []):
        out.append(("topologySpread", t["labelSelector"]))
    for s in objects(name, "Service").values():
        out.append((f"Service/{s['metadata']['name']}", {"matchLabels": s["spec"]["selector"]}))
    for p in objects(name, "PodDisruptionBudget").values():
        out.append((f"PDB/{p['metadata']['name']}", p["spec"]["selector"]))
    for p in objects(name, "PodMonitor").values():
        out.append((f"PodMonitor/{p['metadata']['name']}", p["spec"]["selector"]))
    for p in objects(name, "NetworkPolicy").values():
        if p["spec"]["podSelector"]:  # {} is the namespace-wide default deny
            out.append((f"NetworkPolicy/{p['metadata']['name']}", p["spec"]["podSelector"]))
    return out


@pytest.mark.parametrize("name", ALL)
def test_selectors_carry_the_instance_label(name):
    assert pod_labels(name).get(INSTANCE_LABEL) == instance(name)
    for where, sel in _selectors(name):
        assert sel.get("matchLabels", {}).get(INSTANCE_LABEL) == instance(name), \
            f"{name}: {where} does not select by {INSTANCE_LABEL}={instance(name)}"
        assert _selector_matches(sel, pod_labels(name)), f"{name}: {where} does not select the cells"


def test_two_installs_in_one_namespace_do_not_select_each_other():
    a, b = "cpu", "cpu-b"
    assert instance(a) != instance(b)
    for mine, other in ((a, b), (b, a)):
        for where, sel in _selectors(mine):
            assert not _selector_matches(sel, pod_labels(other)), f"{mine}'s {where} selects {other}'s cells"
    # and nothing of one overwrites the other (the Namespace is only in the first)
    names = lambda n: {(o["kind"], o["metadata"]["name"]) for o in render(n) if o["kind"] != "Namespace"}  # noqa: E731
    assert not names(a) & names(b), f"objects of both installs: {sorted(names(a) & names(b))}"
    assert not objects(b, "Namespace"), "the second install must not own (or delete) the namespace"


@pytest.mark.parametrize("name", ALL)
def test_network_policy(name):
    pols = objects(name, "NetworkPolicy")
    deny = pols[f"specd-default-deny-ingress{sfx(name)}"]["spec"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"] and not deny.get("ingress")
    labels = pod_labels(name)
    opened: dict[int, list] = {}
    for pol in pols.values():
        if not _selector_matches(pol["spec"]["podSelector"], labels):
            continue
        for rule in pol["spec"].get("ingress", []):
            assert rule.get("ports"), f"{pol['metadata']['name']}: a rule without ports opens every port"
            for p in rule["ports"]:
                assert "endPort" not in p, "port ranges could open a worker port"
                opened.setdefault(p["port"], []).append(rule.get("from"))
    # The worker ports: no rule at all. Their router reaches them over the
    # pod's loopback, which NetworkPolicies never filter.
    for role in WORKERS:
        assert GRPC_PORTS[role] not in opened, f"{name}: a NetworkPolicy admits the {role}'s gRPC port"
    # The public API: router ports only.
    assert {GRPC_PORTS["router"], ROUTER_HTTP_PORT} <= set(opened)
    assert set(opened) <= {GRPC_PORTS["router"], ROUTER_HTTP_PORT} | set(METRICS_PORTS.values())
    # Metrics: every container's port, only from Prometheus in another
    # namespace, whose pod selector must not carry specd's instance label.
    for role, port in METRICS_PORTS.items():
        peers = opened.get(port)
        assert peers and all(p for p in peers), f"{name}: Prometheus must reach the {role} metrics port, and only it"
        for frm in peers:
            for peer in frm:
                assert "namespaceSelector" in peer, f"{name}: metrics peer outside the monitoring namespace: {peer}"
                assert INSTANCE_LABEL not in peer.get("podSelector", {}).get("matchLabels", {}), \
                    f"{name}: kustomize put {INSTANCE_LABEL} into the Prometheus peer selector"


# --------------------------------------------------------------------------
# autoscaling components: prometheus-adapter, KEDA


def _adapter_rules_cover(rules: list[dict], metric: str) -> bool:
    for r in rules:
        res = r.get("resources", {}).get("overrides", {})
        if (metric in r["seriesQuery"] and r.get("name", {}).get("as") == metric
                and res.get("pod", {}).get("resource") == "pod" and res.get("namespace", {}).get("resource") == "namespace"
                and "<<.Series>>" in r["metricsQuery"] and "<<.LabelMatchers>>" in r["metricsQuery"]
                and "<<.GroupBy>>" in r["metricsQuery"]):
            return True
    return False


def test_prometheus_adapter_component_serves_the_hpa_metrics():
    cms = objects("cpu+adapter", "ConfigMap")
    assert "specd-prometheus-adapter-rules" in cms, sorted(cms)
    (rendered,) = load_yaml(cms["specd-prometheus-adapter-rules"]["data"]["config.yaml"])
    component = K8S / "components" / "prometheus-adapter"
    (values,) = load_yaml((component / "helm-values.yaml").read_text())
    # the Helm values carry the same rules as the adapter's config file
    assert values["rules"]["custom"] == rendered["rules"]
    # every Pods metric the HPA asks for is served
    hpa = next(iter(objects("cpu", "HorizontalPodAutoscaler").values()))
    for m in hpa["spec"]["metrics"]:
        name = m["pods"]["metric"]["name"]
        assert _adapter_rules_cover(rendered["rules"], name), f"no adapter rule serves {name}"
    # the adapter's rules are config, never a change to what else renders
    assert {(o["kind"], o["metadata"]["name"]) for o in render("cpu+adapter")} - \
        {(o["kind"], o["metadata"]["name"]) for o in render("cpu")} == {("ConfigMap", "specd-prometheus-adapter-rules")}


def test_keda_component_replaces_the_hpa():
    assert not objects("cpu+keda", "HorizontalPodAutoscaler"), "KEDA makes its own HPA; two would fight"
    (so,) = objects("cpu+keda", "ScaledObject").values()
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    spec = so["spec"]
    assert spec["scaleTargetRef"]["name"] == cell("cpu+keda")["metadata"]["name"]
    hpa = next(iter(objects("cpu", "HorizontalPodAutoscaler").values()))["spec"]
    assert spec["minReplicaCount"] == hpa["minReplicas"] >= 2 and spec["maxReplicaCount"] == hpa["maxReplicas"]
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa["behavior"]
    queries = {}
    for t in spec["triggers"]:
        assert t["type"] == "prometheus" and t.get("metricType", "AverageValue") == "AverageValue"
        md = t["metadata"]
        assert md["serverAddress"].startswith("http") and _promql_balanced(md["query"])
        for metric in (QUEUED, RUNNING):
            if metric in md["query"]:
                queries[metric] = md
                # the install's own cells only
                assert 'namespace="specd"' in md["query"] and f'app_kubernetes_io_instance="{DEFAULT_INSTANCE}"' in md["query"]
    # the same targets as the HPA it replaces
    for metric in (QUEUED, RUNNING):
        target = _pods_metric({"spec": hpa}, metric)
        if target:
            assert float(queries[metric]["threshold"]) == float(target["averageValue"]), metric
    assert QUEUED in queries


# --------------------------------------------------------------------------
# Grafana dashboard


def _dashboard() -> dict:
    with open(DASHBOARD) as f:
        return json.load(f)


def _panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def _exprs(panel: dict) -> list[str]:
    return [t["expr"] for t in panel.get("targets", [])]


def _query_shape(expr: str) -> str:
    """The query without its label matchers, every range window as [w]."""
    return re.sub(r"\[[^\]]*\]", "[w]", re.sub(r"\{[^}]*\}", "", expr))


def _panel(dash: dict, title: str) -> dict:
    found = [p for p in _panels(dash) if p.get("title") == title]
    assert len(found) == 1, f"dashboard needs exactly one panel titled {title!r}, has {len(found)}"
    return found[0]


def test_dashboard_structure():
    dash = _dashboard()
    assert dash.get("uid") and dash.get("title") and isinstance(dash.get("schemaVersion"), int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables.get("datasource")
    assert ds and ds["type"] == "datasource" and ds["query"] == "prometheus", "needs a Prometheus datasource variable"
    ids = [p["id"] for p in _panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in _panels(dash):
        assert {"x", "y", "w", "h"} <= set(p["gridPos"])
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, f"{p['title']}: hard-coded datasource"
        assert p.get("targets"), f"{p['title']}: no queries"
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            assert _promql_balanced(t["expr"]), f"{p['title']}: unbalanced PromQL {t['expr']}"


def test_dashboard_panels():
    dash = _dashboard()

    acc = _panel(dash, "Acceptance rate")
    assert [_query_shape(e) for e in _exprs(acc)] == [ACCEPTANCE_RATE_SHAPE], _exprs(acc)

    tput = next(p for p in _panels(dash) if "throughput" in p.get("title", "").lower())
    assert any("rate(specd_generation_tokens_total" in e for e in _exprs(tput))

    for metric in ("specd_time_to_first_token_seconds", "specd_inter_token_latency_seconds"):
        exprs = [e for p in _panels(dash) for e in _exprs(p) if f"{metric}_bucket" in e]
        for q in ("0.5", "0.95"):
            assert any(e.startswith(f"histogram_quantile({q},") for e in exprs), f"{metric}: no p{q} panel query"

    pos = _panel(dash, "Acceptance by position")
    assert any("specd_spec_decode_num_accepted_tokens_per_pos_total" in e and "by (position)" in e for e in _exprs(pos))

    rpc = [p for p in _panels(dash) if any("specd_worker_rpc_latency_seconds_bucket" in e for e in _exprs(p))]
    assert rpc, "no worker RPC latency panel"
    assert all(re.search(r"by \(le, worker, method\)", e) for e in _exprs(rpc[0])), "RPC latency must be split by worker and method"

    sessions = [e for p in _panels(dash) for e in _exprs(p)]
    assert any("specd_sessions_running" in e for e in sessions)
    assert any("specd_sessions_queued" in e for e in sessions)

    up = _panel(dash, "Draft worker up")
    assert any("specd_draft_worker_up" in e for e in _exprs(up))


# --------------------------------------------------------------------------
# the install script the tests depend on


def test_install_script_is_sane():
    script = REPO / ".ci" / "install-deploy-tools"
    assert script.is_file(), f"{script} is missing"
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text
    assert ".venv-tools" in text and "checkov==" in text and "kubernetes-validate==" in text
    proc = _run(["bash", "-n", str(script)])
    assert proc.returncode == 0, proc.stderr
