"""The rljob-operator Helm chart, rendered by the real helm CLI (no cluster needed).

helm lint --strict and helm template with the defaults and every ci/*-values.yaml; values.schema.json
refusing bad values with a message naming them; the CRD copy and the README values table in sync; the
hardened operator pod; RBAC that covers what the operator does and what it must grant the trainer;
monitors that select the pods the builders create; the PrometheusRule built from the plain rules file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from rljob.api.load import load_rljob
from rljob.operator.builders import JobRef, build_children
from rljob.operator.builders.meta import LABEL_ROLE, ROLE_INFERENCE, ROLE_TRAINER
from rljob.operator.builders.trainer import role as trainer_role
from rljob.common.kube import PLURALS
from tests.cluster.binaries import BinariesUnavailable, binary_path, ensure_built
from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rljob-operator"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
RULES_FILE = CHART / "files" / "rljob-alerts.rules.yaml"
# The runbook base of the plain rules file; the chart requires prometheusRule.runbookBaseUrl with the rules.
RUNBOOK_BASE = "https://github.com/rljob/rljob/blob/main/docs/runbooks"
# The alerts as shipped: the rules, their runbook base, and the operator's ServiceMonitor (RLJobOperatorDown needs it).
RULES_ON = ["prometheusRule.enabled=true", f"prometheusRule.runbookBaseUrl={RUNBOOK_BASE}", "serviceMonitor.enabled=true"]
# helm template knows no cluster: render for the version the local control plane runs.
KUBE_VERSION = re.search(r"^K8S_VERSION=(\S+)", (ROOT / "tests/cluster/localkube.sh").read_text(), re.M).group(1)  # type: ignore[union-attr]

Manifest = dict[str, Any]


class Yaml12Loader(yaml.SafeLoader):
    """PyYAML reads YAML 1.1, where `1e-05` is a string; helm (Go) writes floats that way."""


Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def helm_binary() -> Path:
    """The cached helm CLI (built once from its Go module); skip only when cluster tools are disabled."""
    try:
        ensure_built(("helm",))
    except BinariesUnavailable as exc:
        if os.environ.get("RLJOB_SKIP_CLUSTER") == "1":
            pytest.skip(f"helm is not built and RLJOB_SKIP_CLUSTER=1: {exc}")
        pytest.fail(f"helm is needed for the chart tests: {exc}", pytrace=False)
    return binary_path("helm")


@pytest.fixture(scope="module")
def helm() -> Path:
    return helm_binary()


def run_helm(helm: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run helm; on failure (with check) show its output."""
    proc = subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120, check=False)
    if check and proc.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}", pytrace=False)
    return proc


def template_args(values_files: Iterable[Path] = (), sets: Iterable[str] = (), chart: Path = CHART) -> list[str]:
    """Arguments of `helm template` for the release `rljob` in namespace rljob-system."""
    args = ["template", "rljob", str(chart), "--namespace", "rljob-system", "--kube-version", KUBE_VERSION]
    for path in values_files:
        args += ["-f", str(path)]
    for item in sets:
        args += ["--set", item]
    return args


def render(helm: Path, values_files: Iterable[Path] = (), sets: Iterable[str] = (), chart: Path = CHART) -> list[Manifest]:
    """The objects `helm template` renders."""
    out = run_helm(helm, *template_args(values_files, sets, chart)).stdout
    return [doc for doc in yaml.load_all(out, Loader=Yaml12Loader) if doc]


def find(objects: list[Manifest], kind: str, name: str | None = None) -> Manifest:
    matches = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, got {[o['metadata']['name'] for o in matches]}"
    return matches[0]


def load_chart_sync() -> ModuleType:
    """charts/tools/chart_sync.py (a script, not a package)."""
    return load_script(ROOT / "charts/tools/chart_sync.py")


# ---------------------------------------------------------------------------------------------
# lint, render, schema


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda p: p.name if p else "defaults")
def test_lint_strict_and_template(helm: Path, values: Path | None) -> None:
    files = [values] if values else []
    lint = run_helm(helm, "lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION, *[a for f in files for a in ("-f", str(f))])
    assert "0 chart(s) failed" in lint.stdout
    objects = render(helm, files)
    deployment = find(objects, "Deployment")
    # Leader election (on by default) lets a rollout's new pod wait as a standby: no Recreate gap.
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--leader-elect" in args and "--leader-election-namespace=rljob-system" in args
    for obj in objects:
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm", obj["metadata"]["name"]


BAD_VALUES: list[tuple[list[str], str]] = [
    (["replicaCount=2", "leaderElection.enabled=false"], "/replicaCount"),
    (["leaderElection.leaseSeconds=1"], "/leaderElection/leaseSeconds"),
    (["operatr.verbose=true"], "additional properties 'operatr' not allowed"),
    (["operator.watchNamespaces={Team_A}"], "/operator/watchNamespaces/0"),
    (["image.tag=latest"], "/image/tag"),
    (["image.pullPolicy=Sometimes"], "/image/pullPolicy"),
    (["serviceMonitor.interval=30 seconds"], "/serviceMonitor/interval"),
    (["prometheusRule.thresholds.truncationRate=3"], "/prometheusRule/thresholds/truncationRate"),
    (["prometheusRule.severity.RLJobRolloutStalled=page"], "/prometheusRule/severity/RLJobRolloutStalled"),
    (["resources.limits.memory=lots"], "/resources/limits/memory"),
    (["crds.install=yes"], "/crds/install"),
    (["networkPolicy.monitoringNamespace=Monitoring_NS"], "/networkPolicy/monitoringNamespace"),
]


@pytest.mark.parametrize(("sets", "where"), BAD_VALUES, ids=[s[0][0] for s in BAD_VALUES])
def test_schema_refuses_bad_values_naming_them(helm: Path, sets: list[str], where: str) -> None:
    proc = run_helm(helm, *template_args(sets=sets), check=False)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert where in proc.stderr, proc.stderr


def test_template_refuses_unknown_alert_names(helm: Path) -> None:
    proc = run_helm(helm, *template_args(sets=["prometheusRule.enabled=true", "prometheusRule.for.RLJobTypo=5m"]), check=False)
    assert proc.returncode != 0 and 'unknown alert "RLJobTypo"' in proc.stderr, proc.stderr


def test_schema_declares_every_value() -> None:
    sync = load_chart_sync()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    undeclared = [p for p in sync.leaf_paths(values) if sync.schema_node(schema, p) is None]
    assert not undeclared, f"values.schema.json does not declare {undeclared}"
    assert schema["additionalProperties"] is False


def test_readme_documents_every_value_and_crd_copy_is_in_sync() -> None:
    sync = load_chart_sync()
    assert sync.undocumented((CHART / "values.yaml").read_text()) == []
    stale = [str(p.relative_to(ROOT)) for p in sync.stale_files()]
    assert not stale, f"{stale} out of date: run python charts/tools/chart_sync.py"
    readme = (CHART / "README.md").read_text()
    for path in sync.leaf_paths(yaml.safe_load((CHART / "values.yaml").read_text())):
        documented = path
        while f"`{documented}`" not in readme and "." in documented:
            documented = documented.rsplit(".", 1)[0]
        assert f"`{documented}`" in readme, f"README values table lacks {path}"


def test_sync_check_reports_a_stale_crd_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sync = load_chart_sync()
    stale_copy = tmp_path / "rljob.io_rljobs.yaml"
    stale_copy.write_text("# an old CRD\n")
    monkeypatch.setattr(sync, "CRD_COPY", stale_copy)
    assert sync.stale_files() == [stale_copy]
    assert sync.main(["--check"]) == 1


# ---------------------------------------------------------------------------------------------
# CRD


def test_crd_is_the_generated_one_with_keep_policy(helm: Path) -> None:
    crd = find(render(helm), "CustomResourceDefinition")
    generated = yaml.safe_load((ROOT / "crds/rljob.io_rljobs.yaml").read_text())
    assert crd["spec"] == generated["spec"]
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    unkept = find(render(helm, sets=["crds.keep=false"]), "CustomResourceDefinition")
    assert "helm.sh/resource-policy" not in (unkept["metadata"].get("annotations") or {})
    assert not [o for o in render(helm, sets=["crds.install=false"]) if o["kind"] == "CustomResourceDefinition"]


# ---------------------------------------------------------------------------------------------
# operator pod


def test_operator_pod_is_hardened_and_probed(helm: Path) -> None:
    pod = find(render(helm), "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert any(v["name"] == "tmp" and "emptyDir" in v for v in pod["volumes"])
    health = next(p["containerPort"] for p in container["ports"] if p["name"] == "health")
    assert f"--liveness=http://0.0.0.0:{health}/healthz" in container["args"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["resources"]["limits"]["memory"] and container["resources"]["requests"]["cpu"]
    assert container["image"] == "rljob/operator:" + yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert "--all-namespaces" in container["args"]


def test_operator_settings_reach_the_container(helm: Path) -> None:
    objects = render(helm, [CHART / "ci/monitoring-values.yaml"])
    env = {e["name"]: e.get("value") for e in find(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["RLJOB_PROMETHEUS_ADDRESS"] == "http://prometheus-operated.monitoring:9090"
    assert "RLJOB_PROMETHEUS_ALLOWED_ADDRESSES" not in env, "no job-chosen Prometheus unless the chart lists it"
    volume_types = env["RLJOB_ALLOWED_VOLUME_TYPES"].split(",")
    assert "hostPath" not in volume_types and "emptyDir" in volume_types, "hostPath only when the chart allows it"
    host = render(helm, sets=["jobPods.allowHostPath=true"])
    env_host = {e["name"]: e.get("value") for e in find(host, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env_host["RLJOB_ALLOWED_VOLUME_TYPES"].split(",")[-1] == "hostPath"
    allowed = render(helm, sets=["autotune.prometheus.allowedAddresses={http://thanos.monitoring:9090,https://prom.example.com/p}"])
    env = {e["name"]: e.get("value") for e in find(allowed, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["RLJOB_PROMETHEUS_ALLOWED_ADDRESSES"] == "http://thanos.monitoring:9090,https://prom.example.com/p"
    minimal = find(render(helm, [CHART / "ci/minimal-values.yaml"]), "Deployment")["spec"]["template"]["spec"]
    assert minimal["containers"][0]["image"].startswith("registry.example.com/ml/rljob-operator@sha256:")
    assert minimal["serviceAccountName"] == "rljob-operator"


def test_network_policy_values_reach_the_operator(helm: Path) -> None:
    """The chart's networkPolicy values become the operator's flags, which main() hands to the handlers."""
    from rljob.operator.builders.network import NetworkPolicySettings

    def settings(sets: list[str]) -> NetworkPolicySettings:
        args = find(render(helm, sets=sets), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
        enabled = "--network-policy" in args
        assert enabled != ("--no-network-policy" in args), args
        ns = [a.split("=", 1)[1] for a in args if a.startswith("--monitoring-namespace=")]
        return NetworkPolicySettings(enabled=enabled, monitoring_namespace=(ns or [""])[0] or None)

    assert settings([]) == NetworkPolicySettings(enabled=True, monitoring_namespace="monitoring")
    assert settings(["networkPolicy.monitoringNamespace=obs"]).monitoring_namespace == "obs"
    assert settings(["networkPolicy.monitoringNamespace="]) == NetworkPolicySettings(enabled=True)
    assert settings(["networkPolicy.enabled=false"]).enabled is False


# ---------------------------------------------------------------------------------------------
# RBAC


def rules_allow(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    """Whether RBAC rules allow one verb (resourceNames-restricted rules count as allowing)."""
    return any(
        group in r.get("apiGroups", []) and resource in r.get("resources", []) and verb in r.get("verbs", [])
        for r in rules
    )


def operator_rules(objects: list[Manifest], namespaced: bool = False) -> list[dict[str, Any]]:
    if namespaced:
        return [r for o in objects if o["kind"] == "Role" for r in o["rules"]]
    return find(objects, "ClusterRole", "rljob-rljob-operator")["rules"]


def test_operator_role_covers_every_kind_it_applies_and_what_it_grants_the_trainer(helm: Path) -> None:
    rules = operator_rules(render(helm))
    # Server-side apply of a child reads it, and creates or patches it.
    special = {
        "events": ("create",),
        "pods": ("list", "watch"),
        "jobs": ("get", "watch", "create", "patch", "delete"),
        "rljobs": ("get", "list", "watch", "patch"),
        "secrets": ("get", "create"),  # the engine key is created once, never patched
    }
    for (api_version, _kind), resource in PLURALS.items():
        group = api_version.rsplit("/", 1)[0] if "/" in api_version else ""
        for verb in special.get(resource, ("get", "create", "patch")):
            assert rules_allow(rules, group, resource, verb), f"operator may not {verb} {group}/{resource}"
    # Every kind the watch cache serves is watched (listed first) by the operator.
    from rljob.operator.cache import CACHED_KINDS

    for api_version, kind in CACHED_KINDS:
        group = api_version.rsplit("/", 1)[0] if "/" in api_version else ""
        for verb in ("list", "watch"):
            assert rules_allow(rules, group, PLURALS[api_version, kind], verb), f"operator may not {verb} {kind}"
    # RBAC escalation prevention: the operator can create the trainer's Role only if it holds every
    # permission in it (it has no escalate/bind verbs, on purpose).
    job = JobRef(name="demo", namespace="ml", uid="u")
    for rule in trainer_role(job)["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert rules_allow(rules, group, resource, verb), f"trainer Role grants {verb} {resource}"
    assert not any({"escalate", "bind", "impersonate", "*"} & set(r["verbs"]) for r in rules)
    assert not any("*" in r["resources"] or "*" in r["apiGroups"] for r in rules)
    # Secrets: get and create only (engine keys, the job's own Prometheus token); never list, watch or change one.
    secret_verbs = {v for r in rules if "secrets" in r["resources"] for v in r["verbs"]}
    assert secret_verbs == {"get", "create"}, secret_verbs
    # Children carry blockOwnerDeletion, which OwnerReferencesPermissionEnforcement allows only with this.
    assert rules_allow(rules, "rljob.io", "rljobs/finalizers", "update")
    # Pods stuck on an out-of-service node: the operator reads their Node and force-deletes them.
    assert rules_allow(rules, "", "nodes", "get") and not rules_allow(rules, "", "nodes", "list")
    assert rules_allow(rules, "", "pods", "delete")


def test_watch_namespaces_use_roles_not_a_cluster_wide_grant(helm: Path) -> None:
    objects = render(helm, [CHART / "ci/namespaced-values.yaml"])
    roles = [o for o in objects if o["kind"] == "Role" and not o["metadata"]["name"].endswith("-leader-election")]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["ml-team-a", "ml-team-b"]
    # The leader election Role grants Leases in the release namespace only.
    election = find(objects, "Role", "rljob-rljob-operator-leader-election")
    assert election["metadata"]["namespace"] == "rljob-system"
    assert election["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]}]
    assert rules_allow(operator_rules(objects, namespaced=True), "", "secrets", "get")
    cluster_reads = find(objects, "ClusterRole", "rljob-rljob-operator-cluster-reads")["rules"]
    assert sorted(r["resources"][0] for r in cluster_reads) == ["customresourcedefinitions", "namespaces", "nodes"]
    assert all(set(r["verbs"]) == ({"get"} if r["resources"] == ["nodes"] else {"get", "list", "watch"}) for r in cluster_reads)
    args = find(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=ml-team-a" in args and "--namespace=ml-team-b" in args and "--all-namespaces" not in args
    podmonitor = find(objects, "PodMonitor")
    assert podmonitor["spec"]["namespaceSelector"] == {"matchNames": ["ml-team-a", "ml-team-b"]}


def test_user_roles_aggregate_and_viewer_is_read_only(helm: Path) -> None:
    objects = render(helm)
    editor, viewer = find(objects, "ClusterRole", "rljob-editor"), find(objects, "ClusterRole", "rljob-viewer")
    assert editor["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert viewer["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert rules_allow(editor["rules"], "rljob.io", "rljobs", "create")
    assert not rules_allow(editor["rules"], "rljob.io", "rljobs/status", "patch")
    assert {v for r in viewer["rules"] for v in r["verbs"]} == {"get", "list", "watch"}


# ---------------------------------------------------------------------------------------------
# monitoring


def example_children(path: Path) -> list[Manifest]:
    job = load_rljob(path)
    return build_children(JobRef(job.metadata.name, "ml", "uid-1"), job.spec, active=True)


def pod_templates(children: list[Manifest], role: str) -> list[dict[str, Any]]:
    return [
        c["spec"]["template"]
        for c in children
        if c["kind"] in ("StatefulSet", "Job") and c["spec"]["template"]["metadata"]["labels"].get(LABEL_ROLE) == role
    ]


def test_pod_monitors_select_the_pods_the_operator_creates(helm: Path) -> None:
    objects = render(helm, [CHART / "ci/monitoring-values.yaml"])
    monitors = {o["metadata"]["name"].rsplit("-", 1)[-1]: o for o in objects if o["kind"] == "PodMonitor"}
    children = example_children(CHART / "examples/mixed-pools.yaml")
    for name, role in (("sglang", ROLE_INFERENCE), ("trainer", ROLE_TRAINER)):
        spec = monitors[name]["spec"]
        templates = pod_templates(children, role)
        assert templates, role
        for template in templates:
            assert spec["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items(), role
            ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
            assert {e["port"] for e in spec["podMetricsEndpoints"]} <= ports, (role, ports)
        assert monitors[name]["metadata"]["labels"]["release"] == "prometheus"
    # Relabelled pod labels exist on inference pods (meta labels use _ for / and .).
    sources = {s for r in monitors["sglang"]["spec"]["podMetricsEndpoints"][0]["relabelings"] for s in r["sourceLabels"]}
    labels = pod_templates(children, ROLE_INFERENCE)[0]["metadata"]["labels"]
    expected = {"__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", k) for k in labels}
    assert sources <= expected, sources - expected


def test_service_monitor_selects_the_metrics_service(helm: Path) -> None:
    objects = render(helm, [CHART / "ci/monitoring-values.yaml"])
    monitor, service = find(objects, "ServiceMonitor"), find(objects, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    container = find(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert service["spec"]["ports"][0]["targetPort"] in {p["name"] for p in container["ports"]}


def plain_rules() -> dict[str, Any]:
    return yaml.safe_load(RULES_FILE.read_text())


def test_prometheus_rule_with_defaults_is_the_plain_rules_file(helm: Path) -> None:
    rule = find(render(helm, sets=RULES_ON), "PrometheusRule")
    assert rule["spec"]["groups"] == plain_rules()["groups"]


def test_runbook_base_url_is_required_with_the_rules(helm: Path) -> None:
    proc = run_helm(helm, *template_args(sets=["prometheusRule.enabled=true"]), check=False)
    assert proc.returncode != 0 and "prometheusRule.runbookBaseUrl is required" in proc.stderr, proc.stderr


def test_operator_down_needs_the_service_monitor(helm: Path) -> None:
    def alerts(*sets: str) -> set[str]:
        rule = find(render(helm, sets=[*RULES_ON, *sets]), "PrometheusRule")
        return {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}

    scraped, unscraped = alerts(), alerts("serviceMonitor.enabled=false")
    assert "RLJobOperatorDown" in scraped and scraped - unscraped == {"RLJobOperatorDown"}


@pytest.mark.parametrize(
    ("sets", "hint"),
    [
        ([], "monitoring.labels.release=<kube-prometheus-stack release name>"),
        ([*RULES_ON, "podMonitors.trainer.enabled=true"], "selects them by `release: <its release name>`"),
        ([*RULES_ON, "monitoring.labels.release=prom", "serviceMonitor.enabled=false"], "RLJobOperatorDown is left out"),
    ],
)
def test_notes_name_the_release_label_and_the_dropped_alert(helm: Path, tmp_path: Path, sets: list[str], hint: str) -> None:
    # `helm template` leaves NOTES.txt out and `install --dry-run` needs a cluster: a copy of the chart
    # renders the same text as a ConfigMap.
    chart = tmp_path / "rljob-operator"
    shutil.copytree(CHART, chart)
    notes_text = (chart / "templates/NOTES.txt").read_text()
    (chart / "templates/_notes.tpl").write_text('{{- define "notes" -}}\n' + notes_text + "\n{{- end }}\n")
    (chart / "templates/notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\ndata:\n  notes: {{ include \"notes\" . | toJson }}\n"
    )
    notes = find(render(helm, sets=sets, chart=chart), "ConfigMap", "notes")["data"]["notes"]
    assert hint in notes, notes
    if "monitoring.labels.release=prom" in sets:
        assert "selects them by" not in notes


def test_prometheus_rule_applies_thresholds_for_severity_and_labels(helm: Path) -> None:
    rule = find(render(helm, [CHART / "ci/monitoring-values.yaml"]), "PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    plain = {r["alert"]: r for g in plain_rules()["groups"] for r in g["rules"]}
    assert "RLJobRewardCollapse" not in alerts and set(plain) - set(alerts) == {"RLJobRewardCollapse"}
    truncation = alerts["RLJobTruncationRateHigh"]
    # The default band top (a runtime that exports no rljob_truncation_band); a job's own band still wins.
    assert truncation["expr"] == plain["RLJobTruncationRateHigh"]["expr"].replace("* 0 + 0.25", "* 0 + 0.4")
    assert truncation["for"] == "30m"
    assert "rljob_policy_entropy < 0.1\n" in alerts["RLJobEntropyCollapse"]["expr"]
    assert "> 3600" in alerts["RLJobNoRecentStep"]["expr"] and "3600 seconds" in alerts["RLJobNoRecentStep"]["annotations"]["description"]
    assert alerts["RLJobNoRecentStep"]["labels"]["severity"] == "critical"
    assert all(a["labels"]["team"] == "ml-platform" for a in alerts.values())
    assert all(g["interval"] == "1m" for g in rule["spec"]["groups"])
    # Everything not overridden is the file's (the runbook under the values' base).
    stalled = plain["RLJobRolloutStalled"]
    runbook = "https://wiki.example.com/ml/rljob/runbooks/rljobrolloutstalled.md"
    assert alerts["RLJobRolloutStalled"] == {
        **stalled, "labels": {**stalled["labels"], "team": "ml-platform"},
        "annotations": {**stalled["annotations"], "runbook_url": runbook},
    }


def test_threshold_sites_missing_from_the_rules_file_fail_the_render(helm: Path, tmp_path: Path) -> None:
    chart = tmp_path / "rljob-operator"
    shutil.copytree(CHART, chart)
    edited = chart / "files/rljob-alerts.rules.yaml"
    edited.write_text(edited.read_text().replace("* 0 + 0.25", "* 0 + 0.35"))
    proc = run_helm(helm, *template_args(sets=RULES_ON, chart=chart), check=False)
    assert proc.returncode != 0
    assert 'alert RLJobTruncationRateHigh no longer contains "* 0 + 0.25"' in proc.stderr, proc.stderr


def test_rendered_rules_pass_promtool(helm: Path, cached_binary: Callable[[str], Path], tmp_path: Path) -> None:
    rule = find(render(helm, [CHART / "ci/monitoring-values.yaml"]), "PrometheusRule")
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    check = subprocess.run(
        [str(cached_binary("promtool")), "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_dashboard_config_map(helm: Path) -> None:
    objects = render(helm, [CHART / "ci/monitoring-values.yaml"])
    dashboard = find(objects, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["namespace"] == "monitoring"
    assert dashboard["metadata"]["annotations"]["grafana_folder"] == "RL"
    shipped = json.loads(dashboard["data"]["rljob-dashboard.json"])
    assert shipped == json.loads((CHART / "files/rljob-dashboard.json").read_text())


# ---------------------------------------------------------------------------------------------
# examples


def test_examples_cover_every_vendor_and_validate() -> None:
    vendors: dict[str, set[str]] = {}
    for path in EXAMPLES:
        job = load_rljob(path)
        vendors[path.stem] = {p.vendor for p in job.spec.rollout.pools}
        assert job.spec.rollout.engine == "sglang", path.name
        children = example_children(path)
        assert {c["kind"] for c in children} >= {"StatefulSet", "Deployment", "Service", "Role"}
    assert {frozenset(v) for v in vendors.values()} == {
        frozenset({"nvidia"}), frozenset({"amd"}), frozenset({"nvidia", "amd"}), frozenset({"cpu"})
    }


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_rljob_validate_accepts_example(example: Path) -> None:
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("rljob")), "validate", "--cluster", str(example)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


def test_rljob_validate_cluster_rejects_a_model_gpu_pools_cannot_load(tmp_path: Path) -> None:
    job = yaml.safe_load(EXAMPLES[0].read_text())
    job["spec"]["model"] = {"path": "/home/me/models/qwen"}
    path = tmp_path / "local-model.yaml"
    path.write_text(yaml.safe_dump(job))
    rljob = str(Path(sys.executable).with_name("rljob"))
    local = subprocess.run([rljob, "validate", str(path)], capture_output=True, text=True, timeout=120)
    assert local.returncode == 0, "a laptop run may use a local folder"
    cluster = subprocess.run([rljob, "validate", "--cluster", str(path)], capture_output=True, text=True, timeout=120)
    assert cluster.returncode == 2 and "spec.model.path" in cluster.stdout and "pvc://" in cluster.stdout, cluster.stdout


def test_runbook_urls_are_absolute_under_the_chart_value(helm: Path) -> None:
    def urls(*sets: str) -> dict[str, str]:
        rule = find(render(helm, sets=[*RULES_ON, *sets]), "PrometheusRule")
        return {r["alert"]: r["annotations"]["runbook_url"] for g in rule["spec"]["groups"] for r in g["rules"]}

    default = urls()
    assert default["RLJobFailed"] == "https://github.com/rljob/rljob/blob/main/docs/runbooks/rljobfailed.md"
    custom = urls("prometheusRule.runbookBaseUrl=https://wiki.example.com/ml/runbooks/")
    assert set(custom) == set(default)
    assert all(url == f"https://wiki.example.com/ml/runbooks/{alert.lower()}.md" for alert, url in custom.items())
