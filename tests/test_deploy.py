"""Checks of the deployment artefacts: deploy/k8s (kustomize), docker/, deploy/grafana.

What runs here:
  * `kubectl kustomize` renders the base and both overlays;
  * every rendered object is validated against the Kubernetes JSON schemas with
    kubernetes-validate (strict: unknown fields are errors), for the oldest and
    the newest Kubernetes version we support; the Prometheus Operator CRDs it
    has no schema for (ServiceMonitor, PrometheusRule) are checked field by
    field here instead;
  * checkov scans the rendered manifests and the Dockerfiles; any failed check
    not in CHECKOV_ALLOW_LIST (each entry with its reason) fails the test;
  * structural rules of our own: gRPC startup/readiness/liveness probes,
    requests and limits, thread counts equal to CPU requests, security
    context, model delivery, GPU placement, network policy, alerts, dashboard.

The tools (checkov, kubernetes-validate) live in their own virtualenv,
$REPO/.venv-tools, installed by `bash .ci/install-deploy-tools`; kubectl comes
from the machine. A missing tool fails the test: it is never skipped.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
TOOLS_BIN = REPO / ".venv-tools" / "bin"
DASHBOARD = REPO / "deploy" / "grafana" / "specd-dashboard.json"
DOCKERFILES = [REPO / "docker" / "Dockerfile.cpu", REPO / "docker" / "Dockerfile.gpu"]
INSTALL_HINT = "install the deploy tools with: bash .ci/install-deploy-tools"

KUSTOMIZATIONS = {
    "base": K8S / "base",
    "cpu": K8S / "overlays" / "cpu",
    "gpu": K8S / "overlays" / "gpu",
    "cpu-pvc": K8S / "overlays" / "cpu-pvc",
}

# Kubernetes versions the manifests must be valid for: 1.30 is the oldest we
# support (the preStop `sleep` action is on by default from 1.30, native gRPC
# probes from 1.27); 1.37 is the newest schema kubernetes-validate 1.37 ships,
# which catches removed or renamed fields.
K8S_VERSIONS = ["1.30.0", "1.37.0"]

# Kinds kubernetes-validate has no schema for; each is checked explicitly below.
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}

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
ACCEPTANCE_RATE_EXPR = (
    "sum(rate(specd_spec_decode_num_accepted_tokens_total[1m]))"
    " / sum(rate(specd_spec_decode_num_draft_tokens_total[1m]))"
)
GRPC_PORTS = {"router": 50051, "target": 50061, "draft": 50062}
METRICS_PORT = 9090
WORKERS = ("target", "draft")


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


@functools.lru_cache(maxsize=None)
def render_text(name: str) -> str:
    proc = _run([_kubectl(), "kustomize", str(KUSTOMIZATIONS[name])])
    if proc.returncode != 0:
        pytest.fail(f"kubectl kustomize {name} failed:\n{proc.stderr}", pytrace=False)
    return proc.stdout


@functools.lru_cache(maxsize=None)
def _render_docs(name: str) -> str:
    # YAML -> JSON with the tools venv's PyYAML (a dependency of both tools), so
    # this test needs nothing beyond pytest in the project's own venv.
    proc = _run(
        [_tool("python"), "-c",
         "import json, sys, yaml; "
         "json.dump([d for d in yaml.safe_load_all(sys.stdin) if d], sys.stdout)"],
        input=render_text(name),
    )
    if proc.returncode != 0:
        pytest.fail(f"rendered {name} is not valid YAML:\n{proc.stderr}", pytrace=False)
    return proc.stdout


def render(name: str) -> list[dict]:
    return json.loads(_render_docs(name))  # fresh copy: tests may not mutate the cache


def objects(name: str, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in render(name) if o["kind"] == kind}


def deployment(name: str, role: str) -> dict:
    deps = objects(name, "Deployment")
    assert f"specd-{role}" in deps, f"{name}: no Deployment specd-{role}"
    return deps[f"specd-{role}"]


def main_container(dep: dict) -> dict:
    containers = dep["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"{dep['metadata']['name']}: expected one container"
    return containers[0]


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def configmap_data(name: str, prefix: str) -> dict[str, str]:
    """Data of the generated ConfigMap `prefix-<hash>`."""
    cms = [o for n, o in objects(name, "ConfigMap").items()
           if re.fullmatch(rf"{re.escape(prefix)}(-[a-z0-9]{{10}})?", n)]
    assert len(cms) == 1, f"{name}: expected one ConfigMap {prefix}, found {len(cms)}"
    return cms[0]["data"]


def container_config(name: str, container: dict) -> dict[str, str]:
    """The environment a container gets: envFrom ConfigMaps, then env."""
    cms = {n: o.get("data", {}) for n, o in objects(name, "ConfigMap").items()}
    merged: dict[str, str] = {}
    for src in container.get("envFrom", []):
        ref = src["configMapRef"]["name"]
        assert ref in cms, f"{name}: {container['name']} references missing ConfigMap {ref}"
        merged.update(cms[ref])
    merged.update({k: v for k, v in env_of(container).items() if v is not None})
    return merged


def cpu_cores(quantity: str) -> float:
    q = str(quantity)
    return int(q[:-1]) / 1000 if q.endswith("m") else float(q)


def all_containers(dep: dict) -> list[dict]:
    spec = dep["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


ALL = list(KUSTOMIZATIONS)


# --------------------------------------------------------------------------
# rendering + schema validation


@pytest.mark.parametrize("name", ALL)
def test_kustomization_renders_expected_objects(name):
    kinds = {(o["kind"], o["metadata"]["name"].rsplit("-", 1)[0] if o["kind"] == "ConfigMap" else o["metadata"]["name"])
             for o in render(name)}
    expected = {
        ("Namespace", "specd"), ("ServiceAccount", "specd"),
        ("ConfigMap", "specd-common"), ("ConfigMap", "specd-router"),
        ("ConfigMap", "specd-target"), ("ConfigMap", "specd-draft"),
        ("Deployment", "specd-router"), ("Deployment", "specd-target"), ("Deployment", "specd-draft"),
        ("Service", "specd-router"), ("Service", "specd-target"), ("Service", "specd-draft"),
        ("PodDisruptionBudget", "specd-router"), ("PodDisruptionBudget", "specd-target"),
        ("PodDisruptionBudget", "specd-draft"),
        ("HorizontalPodAutoscaler", "specd-router"),
        ("NetworkPolicy", "specd-default-deny-ingress"), ("NetworkPolicy", "specd-workers-from-router"),
        ("NetworkPolicy", "specd-router-from-clients"), ("NetworkPolicy", "specd-metrics-from-prometheus"),
        ("ServiceMonitor", "specd"), ("PrometheusRule", "specd"),
    }
    missing = expected - kinds
    assert not missing, f"{name}: missing objects {sorted(missing)}"
    for o in render(name):
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == "specd", f"{name}: {o['kind']}/{o['metadata']['name']} not in namespace specd"


@pytest.mark.parametrize("name", ALL)
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
            # is then covered by test_servicemonitor / test_prometheusrule.
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
def test_servicemonitor(name):
    sms = objects(name, "ServiceMonitor")
    assert list(sms) == ["specd"], f"{name}: expected one ServiceMonitor 'specd'"
    sm = sms["specd"]
    # Required by the CRD: apiVersion/kind/metadata.name, spec.selector; and
    # endpoints, without which nothing is scraped.
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    spec = sm["spec"]
    assert isinstance(spec.get("selector"), dict) and spec["selector"], "ServiceMonitor needs spec.selector"
    endpoints = spec.get("endpoints")
    assert isinstance(endpoints, list) and endpoints, "ServiceMonitor needs spec.endpoints"
    for ep in endpoints:
        assert ep.get("port") == "metrics", f"endpoint must scrape the named port 'metrics': {ep}"
        assert ep.get("path", "/metrics") == "/metrics"
        assert re.fullmatch(r"\d+s", ep.get("interval", "")), f"endpoint interval missing/invalid: {ep}"
        assert int(ep["scrapeTimeout"][:-1]) <= int(ep["interval"][:-1])
        # role label from the Service's component label (metrics carry none).
        assert any(r.get("targetLabel") == "role" for r in ep.get("relabelings", [])), \
            "ServiceMonitor must add a `role` label"
    # It must select exactly the three specd Services, each of which exposes
    # the named metrics port.
    services = objects(name, "Service")
    selected = {n for n, s in services.items() if _selector_matches(spec["selector"], s["metadata"].get("labels", {}))}
    assert selected == {"specd-router", "specd-target", "specd-draft"}, f"ServiceMonitor selects {selected}"
    for n in selected:
        ports = {p["name"]: p for p in services[n]["spec"]["ports"]}
        assert "metrics" in ports and ports["metrics"]["port"] == METRICS_PORT, f"{n} lacks port metrics/{METRICS_PORT}"


@pytest.mark.parametrize("name", ALL)
def test_prometheusrule(name):
    rules = objects(name, "PrometheusRule")
    assert list(rules) == ["specd"], f"{name}: expected one PrometheusRule 'specd'"
    pr = rules["specd"]
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
    err = alerts.get("SpecdHighErrorRate", "")
    assert 'specd_requests_total{outcome!="ok"}' in err, f"error-rate alert must use outcome!=\"ok\": {err}"


# --------------------------------------------------------------------------
# checkov


@pytest.fixture(scope="session")
def checkov_report(tmp_path_factory) -> dict:
    """One checkov run over all three renderings and both Dockerfiles."""
    checkov = _tool("checkov")
    scan = tmp_path_factory.mktemp("checkov")
    for name in ALL:
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


@pytest.mark.parametrize("name", ALL)
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
# Deployments


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("role", ["router", "target", "draft"])
def test_deployment_grpc_probes(name, role):
    dep = deployment(name, role)
    c = main_container(dep)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports.get("grpc") == GRPC_PORTS[role], f"{role}: grpc port should be {GRPC_PORTS[role]}"
    assert ports.get("metrics") == METRICS_PORT
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = c.get(probe)
        assert p, f"{name}/{role}: no {probe}"
        assert set(p) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, f"{name}/{role}: {probe} must be a native gRPC probe"
        assert p["grpc"]["port"] == GRPC_PORTS[role], f"{name}/{role}: {probe} probes the wrong port"
        # startup and readiness follow whether the process can serve (service
        # ""); liveness asks only whether it is alive, which stays SERVING while
        # loading and draining, so a draining pod is not killed early
        want = "liveness" if probe == "livenessProbe" else None
        assert p["grpc"].get("service") == want, f"{name}/{role}: {probe} asks for service {p['grpc'].get('service')}"
    st = c["startupProbe"]
    startup_budget = st.get("periodSeconds", 10) * st.get("failureThreshold", 3)
    assert startup_budget >= 120, f"{name}/{role}: startup budget {startup_budget}s is too short for model loading"


@pytest.mark.parametrize("name", ALL)
def test_the_drain_window_covers_the_worst_case_request(name):
    """A rollout must not cut an admitted request: the router bounds every
    request (tokens and time), and every pod drains at least that long."""
    router = container_config(name, main_container(deployment(name, "router")))
    assert int(router["SPECD_MAX_TOKENS_LIMIT"]) > 0
    timeout = float(router["SPECD_REQUEST_TIMEOUT"])
    assert timeout > 0
    for role in ("router", "target", "draft"):
        dep = deployment(name, role)
        grace = float(container_config(name, main_container(dep))["SPECD_GRACE_SECONDS"])
        assert grace >= timeout, f"{name}/{role}: grace {grace}s < request timeout {timeout}s"
        assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= grace + 5


@pytest.mark.parametrize("name", ALL)
def test_router_waits_at_least_as_long_as_target_loads(name):
    # The router is NOT_SERVING until its target answers, so its startup
    # budget must cover the target's, or it restart-loops during a slow load.
    def budget(role):
        p = main_container(deployment(name, role))["startupProbe"]
        return p.get("periodSeconds", 10) * p.get("failureThreshold", 3)
    assert budget("router") >= budget("target"), f"{name}: router startup {budget('router')}s < target {budget('target')}s"


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("role", ["router", "target", "draft"])
def test_deployment_resources(name, role):
    dep = deployment(name, role)
    for c in all_containers(dep):
        res = c.get("resources", {})
        for kind in ("requests", "limits"):
            for r in ("cpu", "memory"):
                assert r in res.get(kind, {}), f"{name}/{role}/{c['name']}: no {kind}.{r}"
        assert cpu_cores(res["limits"]["cpu"]) >= cpu_cores(res["requests"]["cpu"])
        # Memory is not compressible: limit = request everywhere.
        assert res["limits"]["memory"] == res["requests"]["memory"], f"{name}/{role}/{c['name']}: memory limit != request"
    if role in WORKERS:
        # Guaranteed QoS for the workers (exclusive cores under the static CPU
        # manager): every container, init included, has requests == limits.
        for c in all_containers(dep):
            res = c["resources"]
            assert res["limits"]["cpu"] == res["requests"]["cpu"], f"{name}/{role}/{c['name']}: cpu limit != request"


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("role", ["router", "target", "draft"])
def test_thread_counts_match_cpu_requests(name, role):
    c = main_container(deployment(name, role))
    env = env_of(c)
    cpu = cpu_cores(c["resources"]["requests"]["cpu"])
    assert cpu == int(cpu) and cpu >= 1, f"{name}/{role}: CPU request must be whole cores, is {cpu}"
    # Set explicitly as literals in the Deployment, next to the resources.
    assert env.get("OMP_NUM_THREADS") is not None, f"{name}/{role}: OMP_NUM_THREADS not set explicitly"
    assert int(env["OMP_NUM_THREADS"]) == int(cpu), f"{name}/{role}: OMP_NUM_THREADS {env['OMP_NUM_THREADS']} != CPU request {cpu}"
    if role in WORKERS:
        assert env.get("SPECD_THREADS") is not None, f"{name}/{role}: SPECD_THREADS not set explicitly"
        assert int(env["SPECD_THREADS"]) == int(cpu), f"{name}/{role}: SPECD_THREADS {env['SPECD_THREADS']} != CPU request {cpu}"
        assert int(env["SPECD_THREADS"]) == int(cpu_cores(c["resources"]["limits"]["cpu"]))


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("role", ["router", "target", "draft"])
def test_deployment_security(name, role):
    dep = deployment(name, role)
    pod = dep["spec"]["template"]["spec"]
    psc = pod["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] >= 10000
    assert psc["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == "specd"
    assert pod["enableServiceLinks"] is False, "injected SPECD_*_PORT variables could clobber settings"
    writable = set()
    for c in all_containers(dep):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc.get("privileged", False) is False
        assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add")
        image = c["image"]
        repo, _, tag = image.rpartition(":")
        assert "@sha256:" in image or (repo and tag and tag != "latest" and "/" not in tag), \
            f"{name}/{role}/{c['name']}: image {image} is not pinned"
        writable |= {m["mountPath"] for m in c.get("volumeMounts", []) if not m.get("readOnly")}
    assert "/tmp" in writable, "read-only root fs needs a writable /tmp"
    # Grace period covers preStop + SPECD_GRACE_SECONDS.
    c = main_container(dep)
    grace = int(container_config(name, c)["SPECD_GRACE_SECONDS"])
    pre = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] >= grace + pre, \
        f"{name}/{role}: terminationGracePeriodSeconds < preStop {pre}s + grace {grace}s"


API_KEYS_SECRET = "specd-api-keys"


def _secret_file(name: str, role: str, var: str) -> tuple[str, str]:
    """(Secret, key in it) of the file `var` names, checking that it is a
    read-only mount of a required Secret no other user can read."""
    dep = deployment(name, role)
    c = main_container(dep)
    path = container_config(name, c).get(var)
    assert path, f"{name}/{role}: {var} is not set"
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
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
    # router must present one the workers hold: one Secret in all three pods.
    router = _secret_file(name, "router", "SPECD_WORKER_API_KEY_FILE")
    assert router[0] == API_KEYS_SECRET
    for role in WORKERS:
        assert _secret_file(name, role, "SPECD_API_KEY_FILE") == router, \
            f"{name}: {role} reads its keys from another file than the one the router presents"
        # health stays open, so the probes (test_deployment_grpc_probes) need no key


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("role", WORKERS)
def test_worker_model_delivery(name, role):
    dep = deployment(name, role)
    pod = dep["spec"]["template"]["spec"]
    inits = pod.get("initContainers", [])
    assert [i["name"] for i in inits] == ["models"], f"{name}/{role}: expected the `models` init container"
    init = inits[0]
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
        # rolling with maxSurge needs the old and the new pod (maybe on other
        # nodes) to mount it at once
        assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"] or dep["spec"]["strategy"]["type"] == "Recreate"
    else:
        assert "--default" in argv and not mounts["models"].get("readOnly")
    c = main_container(dep)
    cmounts = {m["name"]: m for m in c["volumeMounts"]}
    assert cmounts["models"]["mountPath"] == "/models" and cmounts["models"].get("readOnly") is True
    cfg = container_config(name, c)
    assert cfg["SPECD_MODEL"] == f"/models/{role}.gguf"
    assert container_config(name, init)["SPECD_CACHE_DIR"].startswith("/models/")
    # The init container uses the CPU image everywhere (no GPU for it).
    assert "cuda" not in init["image"]
    # The scheduler reserves the disk the emptyDir may fill.
    if "emptyDir" in volumes["models"]:
        assert volumes["models"]["emptyDir"]["sizeLimit"] == init["resources"]["requests"]["ephemeral-storage"]


@pytest.mark.parametrize("name", ALL)
def test_router_settings_point_at_worker_services(name):
    services = objects(name, "Service")
    cfg = container_config(name, main_container(deployment(name, "router")))
    for role, key in (("target", "SPECD_TARGET"), ("draft", "SPECD_DRAFT")):
        host, port = cfg[key].rsplit(":", 1)
        assert host == f"specd-{role}", f"{key}={cfg[key]}"
        svc = services[host]
        assert svc["spec"]["type"] == "ClusterIP"
        assert int(port) in {p["port"] for p in svc["spec"]["ports"]}, f"{key} port not on Service {host}"
    for role in ("router", "target", "draft"):
        svc = services[f"specd-{role}"]
        assert svc["spec"].get("type", "ClusterIP") == "ClusterIP"
        dep = deployment(name, role)
        assert _selector_matches({"matchLabels": svc["spec"]["selector"]}, dep["spec"]["template"]["metadata"]["labels"])
        c = main_container(dep)
        assert int(container_config(name, c)["SPECD_PORT"]) == GRPC_PORTS[role]
        assert int(container_config(name, c)["SPECD_METRICS_PORT"]) == METRICS_PORT
    # Workers that share sessions must agree on sequences and context.
    t = container_config(name, main_container(deployment(name, "target")))
    d = container_config(name, main_container(deployment(name, "draft")))
    assert t["SPECD_N_SEQ"] == d["SPECD_N_SEQ"] and t["SPECD_N_CTX"] == d["SPECD_N_CTX"]


def test_gpu_overlay_puts_target_on_gpu():
    dep = deployment("gpu", "target")
    pod = dep["spec"]["template"]["spec"]
    c = main_container(dep)
    assert c["resources"]["limits"].get("nvidia.com/gpu") == 1
    assert c["resources"]["requests"].get("nvidia.com/gpu") == 1
    assert "cuda" in c["image"], f"GPU target must use the CUDA image, not {c['image']}"
    assert any(t.get("key") == "nvidia.com/gpu" and t.get("effect") == "NoSchedule" for t in pod.get("tolerations", []))
    assert pod.get("nodeSelector"), "GPU target needs a nodeSelector"
    assert int(container_config("gpu", c)["SPECD_N_GPU_LAYERS"]) > 0
    assert dep["spec"]["strategy"] == {"type": "Recreate"}, "no spare GPU for a surge pod"
    # A CPU model draft cannot keep up with a GPU target: the draft is on a
    # GPU too (or model-free), the router on CPU.
    draft = deployment("gpu", "draft")
    d = main_container(draft)
    assert container_config("gpu", d).get("SPECD_NGRAM") or (
        d["resources"]["limits"].get("nvidia.com/gpu") == 1 and "cuda" in d["image"]
        and int(container_config("gpu", d)["SPECD_N_GPU_LAYERS"]) > 0 and draft["spec"]["strategy"]["type"] == "Recreate")
    router = main_container(deployment("gpu", "router"))
    assert "nvidia.com/gpu" not in router["resources"]["limits"] and "cuda" not in router["image"]


@pytest.mark.parametrize("name", ALL)
def test_pods_run_on_the_architecture_of_their_images(name):
    for role in ("router", "target", "draft"):
        pod = deployment(name, role)["spec"]["template"]["spec"]
        assert pod.get("nodeSelector", {}).get("kubernetes.io/arch") == "amd64", f"{name}/{role}"


@pytest.mark.parametrize("name", ["base", "cpu", "cpu-pvc"])
def test_cpu_renderings_use_no_gpu(name):
    for role in ("router", "target", "draft"):
        dep = deployment(name, role)
        for c in all_containers(dep):
            assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
            assert "cuda" not in c["image"]
        if role in WORKERS:
            assert int(container_config(name, main_container(dep))["SPECD_N_GPU_LAYERS"]) == 0
        assert not dep["spec"]["template"]["spec"].get("tolerations")


# --------------------------------------------------------------------------
# HPA, PDB, NetworkPolicy


@pytest.mark.parametrize("name", ALL)
def test_hpa_and_pdbs(name):
    hpa = objects(name, "HorizontalPodAutoscaler")["specd-router"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "specd-router"}
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert "replicas" not in deployment(name, "router")["spec"], "the HPA owns the router's replica count"
    pdbs = objects(name, "PodDisruptionBudget")
    for role in ("router", "target", "draft"):
        pdb = pdbs[f"specd-{role}"]
        labels = deployment(name, role)["spec"]["template"]["metadata"]["labels"]
        assert _selector_matches(pdb["spec"]["selector"], labels), f"PDB specd-{role} selects nothing"
        assert ("minAvailable" in pdb["spec"]) != ("maxUnavailable" in pdb["spec"])


@pytest.mark.parametrize("name", ALL)
def test_network_policy(name):
    pols = objects(name, "NetworkPolicy")
    deny = pols["specd-default-deny-ingress"]["spec"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"] and not deny.get("ingress")
    router_labels = deployment(name, "router")["spec"]["template"]["metadata"]["labels"]
    for role in WORKERS:
        labels = deployment(name, role)["spec"]["template"]["metadata"]["labels"]
        grpc_peers, metrics_peers = [], []
        for pol in pols.values():
            if not _selector_matches(pol["spec"]["podSelector"], labels):
                continue
            for rule in pol["spec"].get("ingress", []):
                ports = {p["port"] for p in rule.get("ports", [])}
                assert rule.get("ports"), f"{pol['metadata']['name']}: a rule without ports opens every port"
                assert rule.get("from"), f"{pol['metadata']['name']}: a worker rule without `from` admits everyone"
                if GRPC_PORTS[role] in ports:
                    grpc_peers += rule["from"]
                if METRICS_PORT in ports:
                    metrics_peers += rule["from"]
                assert ports <= set(GRPC_PORTS.values()) | {METRICS_PORT}
        assert grpc_peers, f"{name}: nothing may reach the {role} gRPC port"
        for peer in grpc_peers:
            # Only the router: a pod selector in the policy's own namespace.
            assert set(peer) == {"podSelector"}, f"{role} gRPC peer is not a same-namespace pod selector: {peer}"
            assert _selector_matches(peer["podSelector"], router_labels)
            for other in ("target", "draft"):
                other_labels = deployment(name, other)["spec"]["template"]["metadata"]["labels"]
                assert not _selector_matches(peer["podSelector"], other_labels), f"{other} may reach {role}'s gRPC port"
        assert metrics_peers and all("namespaceSelector" in p for p in metrics_peers), \
            f"{name}: Prometheus (another namespace) must reach the {role} metrics port"


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
    assert _exprs(acc) == [ACCEPTANCE_RATE_EXPR]

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
