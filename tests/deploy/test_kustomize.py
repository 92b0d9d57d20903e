"""Every overlay renders with `kubectl kustomize`, validates against the Kubernetes schemas
(kubernetes-validate, strict) and the shipped Prometheus-operator schemas, and means what the
design says: secure pods, gRPC probes, a journal volume, GPU only where wanted, network
policies that let exactly schedulers/workers/Prometheus in."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.ci import need_module

from .support import DEPLOY, REPO, need

OVERLAYS = ["base", "overlays/dev-cpu", "overlays/prod-gpu", "overlays/prod-gpu-operator", "overlays/ha"]
#: Extra renders through a throw-away kustomization: the components on top of an overlay.
COMBOS = {
    "dev-cpu+prometheus-operator+tls": ("overlays/dev-cpu", ["components/prometheus-operator", "components/tls"]),
    "prod-gpu+tls": ("overlays/prod-gpu", ["components/tls"]),
}
VARIANTS = OVERLAYS + list(COMBOS)
#: Variants with one manager and its journal on a volume (overlays/ha: two managers, state on NATS).
SINGLE_MANAGER = [v for v in VARIANTS if v != "overlays/ha"]
NATS = "StatefulSet/kvservice-nats"
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
#: Oldest Kubernetes the manifests target (native gRPC probes are GA from 1.27) and the newest known.
K8S_VERSIONS = ["1.29.0", "latest"]
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet"}


def _kustomize(path: Path) -> str:
    kubectl = need("kubectl")
    r = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        hint = ""
        if "Component" in r.stderr or "components" in r.stderr:
            hint = ("\n(kubectl's embedded kustomize may be too old for components: "
                    "needs kustomize >= v4, kubectl >= 1.21)")
        pytest.fail(f"kubectl kustomize {path} failed:\n{r.stderr}{hint}")
    return r.stdout


@pytest.fixture(scope="session")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache: dict[str, list[dict]] = {}

    def render(variant: str) -> list[dict]:
        if variant not in cache:
            if variant in COMBOS:
                overlay, components = COMBOS[variant]
                d = tmp_path_factory.mktemp(variant.replace("+", "_"))
                rel = lambda p: os.path.relpath(DEPLOY / p, d)  # noqa: E731 - kustomize refuses absolute paths
                (d / "kustomization.yaml").write_text(yaml.safe_dump({
                    "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                    "resources": [rel(overlay)], "components": [rel(c) for c in components]}))
                text = _kustomize(d)
            else:
                text = _kustomize(DEPLOY / variant)
            cache[variant] = [doc for doc in yaml.safe_load_all(text) if doc]
        return cache[variant]

    return render


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def pod_templates(docs: list[dict]) -> list[tuple[str, dict]]:
    return [(f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"]) for d in docs
            if d["kind"] in WORKLOAD_KINDS]


def matches(selector: dict | None, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions)."""
    if selector is None:
        return False
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def container_port(template: dict, ref: int | str) -> int | None:
    for c in template["spec"]["containers"]:
        for p in c.get("ports", []):
            if ref in (p.get("name"), p["containerPort"]):
                return p["containerPort"]
    return None


# ---- schemas ------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_validates_against_kubernetes_and_crd_schemas(rendered, variant: str) -> None:
    need_module("kubernetes_validate", "pip package kubernetes-validate; the dev extra and deploy/ci-install.sh")
    import kubernetes_validate
    versions = [kubernetes_validate.latest_version() if v == "latest" else v for v in K8S_VERSIONS]
    docs = rendered(variant)
    assert docs
    errors = []
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in CRD_KINDS:
            schema = json.loads((DEPLOY / "schemas" / f"{doc['kind'].lower()}-monitoring-v1.json").read_text())
            for err in jsonschema.Draft202012Validator(schema).iter_errors(doc):
                errors.append(f"{name}: {'.'.join(map(str, err.path))}: {err.message}")
            continue
        for version in versions:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                errors.append(f"{name} (k8s {version}): {'.'.join(map(str, err.path))}: {err.message}")
            except kubernetes_validate.SchemaNotFoundError as err:
                errors.append(f"{name}: no schema: {err.message}")
    assert not errors, "\n".join(errors)


def test_crd_schemas_reject_mistakes() -> None:
    """The shipped CRD schemas are strict enough to catch a typo."""
    schema = json.loads((DEPLOY / "schemas" / "servicemonitor-monitoring-v1.json").read_text())
    good = yaml.safe_load((DEPLOY / "components" / "prometheus-operator" / "servicemonitor.yaml").read_text())
    jsonschema.validate(good, schema)
    bad = json.loads(json.dumps(good))
    bad["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    rule_schema = json.loads((DEPLOY / "schemas" / "prometheusrule-monitoring-v1.json").read_text())
    bad_rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": {"name": "x"},
                "spec": {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "up", "for": "5 minutes"}]}]}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad_rule, rule_schema)


def test_operator_kinds_only_where_asked(rendered) -> None:
    for variant in ("base", "overlays/dev-cpu", "overlays/prod-gpu"):
        kinds = {d["kind"] for d in rendered(variant)}
        assert not kinds & CRD_KINDS, f"{variant} must apply on clusters without the Prometheus operator"
    for variant in ("overlays/prod-gpu-operator", "dev-cpu+prometheus-operator+tls"):
        assert CRD_KINDS <= {d["kind"] for d in rendered(variant)}


# ---- pods ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_pods_are_locked_down_and_sized(rendered, variant: str) -> None:
    templates = pod_templates(rendered(variant))
    assert {n for n, _ in templates} == {"StatefulSet/kvservice-manager", "Deployment/kvworker"} | (
        {NATS} if variant == "overlays/ha" else set())
    for name, tpl in templates:
        spec = tpl["spec"]
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] == 10001, name
        assert psc["seccompProfile"]["type"] == "RuntimeDefault", name
        assert spec["automountServiceAccountToken"] is False, name
        assert spec.get("hostNetwork") is not True and spec.get("hostPID") is not True, name
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            where = f"{name}/{c['name']}"
            assert sc["runAsNonRoot"] is True, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc.get("privileged") is not True, where
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add"), where
            assert sc["seccompProfile"]["type"] == "RuntimeDefault", where
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][part]), f"{where}: {part}"
            image = c["image"]
            assert re.fullmatch(r"[a-z0-9./-]+(:[\w.-]+)?(@sha256:[0-9a-f]{64})?", image) and (
                ":" in image.rsplit("/", 1)[-1] or "@" in image), f"{where}: image {image} has no tag"
            assert not image.endswith(":latest"), where
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                assert probe in c, f"{where}: no {probe}"
                p = c[probe]
                if name == NATS:
                    assert container_port(tpl, p["httpGet"]["port"]) == 8222, f"{where}: {probe}"
                elif "tls" in variant and name.startswith("StatefulSet"):
                    assert p["exec"]["command"][0] == "grpc-health-check", where
                else:
                    assert container_port(tpl, p["grpc"]["port"]), f"{where}: {probe} port is no container port"
            mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
            assert "/tmp" in mounts, f"{where}: read-only root needs a writable /tmp"


@pytest.mark.parametrize("variant", SINGLE_MANAGER)
def test_manager_statefulset_journal_and_pools(rendered, variant: str) -> None:
    from kvservice.server.config import load_pools

    docs = rendered(variant)
    sts = one(docs, "StatefulSet", "kvservice-manager")
    assert sts["spec"]["replicas"] == 1, "the manager is a singleton"
    c = sts["spec"]["template"]["spec"]["containers"][0]
    args = c["args"]
    assert args[0] == "serve" and "--listen=0.0.0.0:50051" in args and "--metrics-addr=0.0.0.0" in args
    assert "--metrics-port=9400" in args
    claim = sts["spec"]["volumeClaimTemplates"][0]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]]["mountPath"] == "/var/lib/kvservice"
    assert sts["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == 10001, "PVC must be writable"
    # pools: the ConfigMap the StatefulSet mounts parses as kvservice pools and has the workers' pool
    pools_arg = next(a.split("=", 1)[1] for a in args if a.startswith("--pools="))
    assert mounts["pools"]["mountPath"] == pools_arg
    cm_name = next(v["configMap"]["name"] for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "pools")
    cm = one(docs, "ConfigMap", cm_name)
    pools = load_pools(cm["data"]["pools.yaml"], f"{variant}: ConfigMap {cm_name}")
    worker = one(docs, "Deployment", "kvworker")["spec"]["template"]["spec"]["containers"][0]
    worker_pool = next(a.split("=", 1)[1] for a in worker["args"] if a.startswith("--pool="))
    assert worker_pool in {p.name for p in pools}
    assert any(a == "--manager=kvservice-manager:50051" for a in worker["args"])
    headless = one(docs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("variant", ["base", "overlays/prod-gpu", "overlays/prod-gpu-operator", "overlays/ha"])
def test_gpu_workers(rendered, variant: str) -> None:
    w = one(rendered(variant), "Deployment", "kvworker")
    c = w["spec"]["template"]["spec"]["containers"][0]
    assert "--backend=cuda" in c["args"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert c["image"].startswith("ghcr.io/kvservice/kvworker:")
    assert any(t["key"] == "nvidia.com/gpu" for t in w["spec"]["template"]["spec"]["tolerations"])
    assert {"--metrics-addr=0.0.0.0", "--advertise=$(POD_IP):50061"} <= set(c["args"])
    assert any(e["name"] == "POD_IP" for e in c["env"]), "$(POD_IP) in args needs the env var"
    if "prod" in variant or "ha" in variant:
        assert w["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


def test_dev_cpu_has_no_gpu(rendered) -> None:
    docs = rendered("overlays/dev-cpu")
    assert "nvidia.com/gpu" not in yaml.safe_dump_all(docs)
    c = one(docs, "Deployment", "kvworker")["spec"]["template"]["spec"]["containers"][0]
    assert "--backend=cpu" in c["args"] and "--metrics-addr=0.0.0.0" in c["args"]
    manager = one(docs, "StatefulSet", "kvservice-manager")["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == manager["image"], "dev-cpu runs kvworker from the manager image (no CUDA base)"
    assert all(d["metadata"].get("namespace") in (None, "kvservice-dev") for d in docs)
    assert one(docs, "Namespace", "kvservice-dev")


# ---- services, disruption budgets ---------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_services_and_pdbs_select_their_pods(rendered, variant: str) -> None:
    docs = rendered(variant)
    templates = pod_templates(docs)
    for svc in by_kind(docs, "Service"):
        sel = {"matchLabels": svc["spec"]["selector"]}
        targets = [t for _, t in templates if matches(sel, t["metadata"]["labels"])]
        assert len(targets) == 1, f"Service {svc['metadata']['name']} selects {len(targets)} workloads"
        for port in svc["spec"]["ports"]:
            assert container_port(targets[0], port["targetPort"]) == port["port"], (svc["metadata"]["name"], port)
    mgr = one(docs, "Service", "kvservice-manager")
    assert {(p["name"], p["port"]) for p in mgr["spec"]["ports"]} == {("grpc", 50051), ("metrics", 9400)}
    for pdb in by_kind(docs, "PodDisruptionBudget"):
        assert sum(matches(pdb["spec"]["selector"], t["metadata"]["labels"]) for _, t in templates) == 1
    pdbs = {"kvservice-manager", "kvworker"} | ({"kvservice-nats"} if variant == "overlays/ha" else set())
    assert {p["metadata"]["name"] for p in by_kind(docs, "PodDisruptionBudget")} == pdbs
    for kind, name in (("StatefulSet", "kvservice-manager"), ("Deployment", "kvworker")):
        w = one(docs, kind, name)
        assert matches(w["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])
        sa = w["spec"]["template"]["spec"]["serviceAccountName"]
        assert one(docs, "ServiceAccount", sa)["automountServiceAccountToken"] is False


def test_operator_monitors_find_their_targets(rendered) -> None:
    docs = rendered("overlays/prod-gpu-operator")
    sm = one(docs, "ServiceMonitor", "kvservice-manager")
    svcs = [s for s in by_kind(docs, "Service") if matches(sm["spec"]["selector"], s["metadata"].get("labels", {}))]
    assert any(p["name"] == sm["spec"]["endpoints"][0]["port"] for s in svcs for p in s["spec"]["ports"])
    pm = one(docs, "PodMonitor", "kvworker")
    worker = one(docs, "Deployment", "kvworker")["spec"]["template"]
    assert matches(pm["spec"]["selector"], worker["metadata"]["labels"])
    assert container_port(worker, pm["spec"]["podMetricsEndpoints"][0]["port"]) == 9500
    # The alerts select job="kvservice-manager" / job="kvworker": the monitors must set exactly these.
    for mon, job, key in ((sm, "kvservice-manager", "endpoints"), (pm, "kvworker", "podMetricsEndpoints")):
        relabel = mon["spec"][key][0]["relabelings"]
        assert {"targetLabel": "job", "replacement": job, "action": "replace"} in relabel


# ---- network policies ----------------------------------------------------------------------------

def allowed(docs: list[dict], target_labels: dict, port: int, src_labels: dict, src_ns: str,
            src_ns_labels: dict | None = None) -> bool:
    """Would the NetworkPolicies of `docs` admit this connection (ingress side)?"""
    ns = next(d["metadata"]["name"] for d in docs if d["kind"] == "Namespace")
    ns_labels = {"kubernetes.io/metadata.name": src_ns, **(src_ns_labels or {})}
    policies = [p for p in by_kind(docs, "NetworkPolicy") if matches(p["spec"]["podSelector"], target_labels)
                and "Ingress" in p["spec"]["policyTypes"]]
    if not policies:
        return True
    for pol in policies:
        for rule in pol["spec"].get("ingress", []):
            if rule.get("ports") and not any(p.get("port") == port for p in rule["ports"]):
                continue
            for peer in rule.get("from") or [{}]:
                if "ipBlock" in peer:
                    continue
                if not peer:
                    return True
                ns_ok = (matches(peer["namespaceSelector"], ns_labels) if "namespaceSelector" in peer
                         else src_ns == ns)
                pod_ok = matches(peer["podSelector"], src_labels) if "podSelector" in peer else True
                if ns_ok and pod_ok:
                    return True
    return False


@pytest.mark.parametrize("variant", ["overlays/dev-cpu", "overlays/prod-gpu", "overlays/ha"])
def test_network_policies(rendered, variant: str) -> None:
    docs = rendered(variant)
    ns = next(d["metadata"]["name"] for d in docs if d["kind"] == "Namespace")
    mgr = one(docs, "StatefulSet", "kvservice-manager")["spec"]["template"]["metadata"]["labels"]
    wrk = one(docs, "Deployment", "kvworker")["spec"]["template"]["metadata"]["labels"]
    scheduler = {"app.kubernetes.io/name": "my-scheduler", "app.kubernetes.io/component": "scheduler"}
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    stranger = {"app": "curl"}
    cases = [
        # target, port, source labels, source namespace, source namespace labels, expected
        (mgr, 50051, scheduler, ns, None, True),
        (mgr, 50051, wrk, ns, None, True),
        (mgr, 50051, scheduler, "serving", {"kvservice.io/scheduler-access": "true"}, True),
        (mgr, 50051, scheduler, "serving", None, False),
        (mgr, 50051, stranger, ns, None, False),
        (mgr, 50051, prometheus, "monitoring", None, False),
        (mgr, 9400, prometheus, "monitoring", None, True),
        (mgr, 9400, prometheus, "default", None, False),
        (mgr, 9400, scheduler, ns, None, False),
        (mgr, 8080, scheduler, ns, None, False),
        (wrk, 50061, scheduler, ns, None, True),
        (wrk, 50061, stranger, ns, None, False),
        (wrk, 50061, mgr, ns, None, False),
        (wrk, 9500, prometheus, "monitoring", None, True),
        (wrk, 9500, stranger, ns, None, False),
    ]
    wrong = [c for c in cases if allowed(docs, c[0], c[1], c[2], c[3], c[4]) != c[5]]
    assert not wrong, wrong
    # egress: workers may reach the manager's gRPC port (and DNS); the manager only DNS
    wpol = one(docs, "NetworkPolicy", "kvworker")
    assert any(matches(peer.get("podSelector"), mgr) and {"port": 50051, "protocol": "TCP"} in rule["ports"]
               for rule in wpol["spec"]["egress"] for peer in rule["to"])
    mpol = one(docs, "NetworkPolicy", "kvservice-manager")
    if variant != "overlays/ha":
        assert all(p["port"] == 53 for rule in mpol["spec"]["egress"] for p in rule["ports"])
        return
    # ha: the managers also dial NATS (4222), and only NATS takes that; NATS routes among its pods
    nats = one(docs, "StatefulSet", "kvservice-nats")["spec"]["template"]["metadata"]["labels"]
    assert {p["port"] for rule in mpol["spec"]["egress"] for p in rule["ports"]} == {53, 4222}
    assert all(matches(peer["podSelector"], nats) for rule in mpol["spec"]["egress"] for peer in rule["to"]
               if any(p["port"] == 4222 for p in rule["ports"]))
    cases = [(nats, 4222, mgr, ns, None, True), (nats, 4222, wrk, ns, None, False),
             (nats, 4222, scheduler, ns, None, False), (nats, 6222, nats, ns, None, True),
             (nats, 6222, mgr, ns, None, False), (nats, 4222, stranger, ns, None, False)]
    wrong = [c for c in cases if allowed(docs, c[0], c[1], c[2], c[3], c[4]) != c[5]]
    assert not wrong, wrong


def test_namespace_enforces_restricted_pod_security(rendered) -> None:
    for variant in ("overlays/dev-cpu", "overlays/prod-gpu"):
        ns = by_kind(rendered(variant), "Namespace")[0]
        assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_tls_component_mounts_the_documented_secret(rendered) -> None:
    docs = rendered("prod-gpu+tls")
    spec = one(docs, "StatefulSet", "kvservice-manager")["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert {"--tls-cert=/etc/kvservice/tls/tls.crt", "--tls-key=/etc/kvservice/tls/tls.key",
            "--tls-client-ca=/etc/kvservice/tls/ca.crt"} <= set(c["args"])
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["tls"]["secret"]["secretName"] == "kvservice-tls"
    assert {"name": "tls", "mountPath": "/etc/kvservice/tls", "readOnly": True} in c["volumeMounts"]
    ops = (REPO / "docs" / "operations.md").read_text()
    for s in ("kvservice-tls", "/etc/kvservice/tls", "--tls-cert", "--tls-key", "--tls-client-ca",
              "kvservice-probe-tls"):
        assert s in ops, f"docs/operations.md does not mention {s}"


# ---- tokens and limits (issue #11) -----------------------------------------------------------------

def _secret_of(spec: dict, container: dict, path: str) -> str:
    """Name of the Secret whose volume holds `path` in the container (mounted read-only, no subPath)."""
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    assert mount.get("readOnly") is True and "subPath" not in mount, mount
    return next(v for v in spec["volumes"] if v["name"] == mount["name"])["secret"]["secretName"]


def _flag(args: list[str], flag: str) -> str | None:
    return next((a.split("=", 1)[1] for a in args if a.startswith(flag + "=")), None)


@pytest.mark.parametrize("variant", VARIANTS)
def test_manager_and_worker_rpcs_need_tokens(rendered, variant: str) -> None:
    """Every gRPC call to the manager and to a worker needs a bearer token; the worker has its own to the manager."""
    docs = rendered(variant)
    for kind, name in (("StatefulSet", "kvservice-manager"), ("Deployment", "kvworker")):
        spec = one(docs, kind, name)["spec"]["template"]["spec"]
        c = spec["containers"][0]
        tokens = _flag(c["args"], "--tokens-file")
        assert tokens, f"{kind}/{name} serves without --tokens-file"
        assert _secret_of(spec, c, tokens) == "kvservice-tokens"
    spec = one(docs, "Deployment", "kvworker")["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert _secret_of(spec, c, _flag(c["args"], "--manager-token-file")) == "kvservice-worker-token"
    ops = (REPO / "docs" / "operations.md").read_text()
    sec = (REPO / "docs" / "SECURITY.md").read_text()
    for s in ("kvservice-tokens", "kvservice-worker-token", "create secret generic"):
        assert s in ops, f"docs/operations.md does not say how to create {s}"
    assert "kvservice-worker-token" in sec


#: docs/SECURITY.md#limits: the manager's memory at its limits is about 6 x the message limit (one Step's
#: request and reply with their copies), 2 x it per other gRPC thread receiving, 25 bytes per slot of
#: max_total_slots and 200 MiB for the process itself.
def _manager_budget(args: list[str]) -> int:
    from kvservice.contract.transport import MAX_MESSAGE_BYTES
    from kvservice.server.limits import Limits

    msg = int(_flag(args, "--max-message-bytes") or MAX_MESSAGE_BYTES)
    threads = int(_flag(args, "--threads") or 8)
    return 6 * msg + 2 * msg * (threads - 1) + 25 * Limits().max_total_slots + (200 << 20)


def _bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    return int(quantity[:-2]) * units[quantity[-2:]] if quantity[-2:] in units else int(quantity)


@pytest.mark.parametrize("variant", VARIANTS)
def test_manager_limits_fit_its_memory_limit(rendered, variant: str) -> None:
    c = one(rendered(variant), "StatefulSet", "kvservice-manager")["spec"]["template"]["spec"]["containers"][0]
    limit = _bytes(c["resources"]["limits"]["memory"])
    assert _manager_budget(c["args"]) <= limit, f"{variant}: limits need {_manager_budget(c['args'])} of {limit}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_manager_memory_budget_fits_its_memory_limit_and_its_largest_step(rendered, variant: str) -> None:
    """docs/SECURITY.md#memory-budget: the process, the pools at max_total_slots (25 bytes a slot), the journal's
    reply cache and the budget fit the pod's limit; the largest request and its reply fit the budget."""
    from kvservice.contract.transport import MAX_MESSAGE_BYTES
    from kvservice.core.units import parse_bytes
    from kvservice.server.budget import PROCESS_BYTES, REPLY_FACTOR, WIRE_FACTOR
    from kvservice.server.limits import Limits
    from kvservice.state.journal_config import JournalConfig

    c = one(rendered(variant), "StatefulSet", "kvservice-manager")["spec"]["template"]["spec"]["containers"][0]
    limit = _bytes(c["resources"]["limits"]["memory"])
    budget = parse_bytes(_flag(c["args"], "--rpc-memory-budget") or 0)
    msg = int(_flag(c["args"], "--max-message-bytes") or MAX_MESSAGE_BYTES)
    assert budget, f"{variant}: the manager's --rpc-memory-budget is set with its memory limit"
    fixed = PROCESS_BYTES + 25 * Limits().max_total_slots + JournalConfig().reply_cache_bytes
    assert fixed + budget <= limit, f"{variant}: {fixed} + budget {budget} > {limit}"
    assert (WIRE_FACTOR + REPLY_FACTOR) * msg <= budget, f"{variant}: the largest Step does not fit the budget"


# ---- high availability -------------------------------------------------------------------------------

def test_ha_overlay_runs_two_managers_on_a_nats_cluster(rendered) -> None:
    docs = rendered("overlays/ha")
    sts = one(docs, "StatefulSet", "kvservice-manager")
    spec, tpl = sts["spec"], sts["spec"]["template"]["spec"]
    assert spec["replicas"] == 2 and spec["podManagementPolicy"] == "Parallel"
    assert spec["updateStrategy"] == {"type": "OnDelete"}, "a standby is never Ready: a rolling update would stall"
    assert "volumeClaimTemplates" not in spec, "the state lives in NATS, not on a volume"
    anti = tpl["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname" and matches(anti["labelSelector"],
                                                                        sts["spec"]["template"]["metadata"]["labels"])
    c = tpl["containers"][0]
    state = next(a.split("=", 1)[1] for a in c["args"] if a.startswith("--state="))
    nats = one(docs, "StatefulSet", "kvservice-nats")
    headless = one(docs, "Service", nats["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert state.split(",") == [f"nats://kvservice-nats-{i}.{headless['metadata']['name']}:4222"
                                for i in range(nats["spec"]["replicas"])]
    assert "--nats-replicas=3" in c["args"] and not any(a.startswith("--state-dir") for a in c["args"])
    assert {"--node-id=$(POD_NAME)", "--advertise=$(POD_IP):50051"} <= set(c["args"])
    assert {e["name"] for e in c["env"]} >= {"POD_NAME", "POD_IP"}
    assert "/var/lib/kvservice" not in {m["mountPath"] for m in c["volumeMounts"]}
    # readiness = leader only (the Service routes to it); liveness = the whole server (standbys pass)
    assert c["readinessProbe"]["grpc"]["service"] == "kvservice.v1.BlockManager"
    assert "service" not in c["livenessProbe"]["grpc"] and "service" not in c["startupProbe"]["grpc"]
    from kvservice.server.app import SERVICE_NAME
    assert c["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    # NATS: three servers on three nodes, the official image, JetStream on a volume each
    assert nats["spec"]["replicas"] == 3 and nats["spec"]["podManagementPolicy"] == "Parallel"
    ntpl = nats["spec"]["template"]["spec"]
    assert ntpl["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0][
        "topologyKey"] == "kubernetes.io/hostname"
    image = ntpl["containers"][0]["image"]
    from kvservice.state.nats import NATS_SERVER_VERSION
    assert image == f"nats:{NATS_SERVER_VERSION}-alpine", "deploy the NATS version the tests run (docs/HA.md)"
    assert nats["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
    cm_name = next(v["configMap"]["name"] for v in ntpl["volumes"] if v["name"] == "config")
    conf = one(docs, "ConfigMap", cm_name)["data"]["nats.conf"]
    assert "jetstream" in conf and "store_dir: /data/jetstream" in conf
    assert re.search(r"(?m)^\s*sync_interval:\s*always\s*$", conf), "fsync before ack (docs/HA.md)"
    assert {m["mountPath"] for m in ntpl["containers"][0]["volumeMounts"]} >= {"/data", "/etc/nats"}
    for i in range(3):
        assert f"nats://kvservice-nats-{i}.kvservice-nats:6222" in conf
    assert "pid_file: /tmp/nats.pid" in conf and "ldm=/tmp/nats.pid" in " ".join(
        ntpl["containers"][0]["lifecycle"]["preStop"]["exec"]["command"])
    # disruption budgets: NATS keeps a Raft quorum (one of three down at most)
    assert one(docs, "PodDisruptionBudget", "kvservice-nats")["spec"]["maxUnavailable"] == 1
    assert one(docs, "PodDisruptionBudget", "kvservice-manager")["spec"]["minAvailable"] == 1
