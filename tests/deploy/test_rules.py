"""Alert rules: promtool check + unit tests (every alert fires and stays quiet somewhere), the
PrometheusRule generated from the one rules file, runbooks, and the plain Prometheus config."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import yaml

from .support import DEPLOY, OPERATIONS, PROMETHEUS_RULE, RULE_TESTS, RULES, need


def alerts() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def _sync_rules():
    spec = importlib.util.spec_from_file_location("sync_rules", DEPLOY / "prometheus" / "sync_rules.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([need("promtool"), *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def test_promtool_check_rules() -> None:
    r = promtool("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in r.stdout


def test_promtool_unit_tests() -> None:
    r = promtool("test", "rules", str(RULE_TESTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for t in case.get("alert_rule_test", []):
            (fires if t.get("exp_alerts") else quiet).add(t["alertname"])
    names = {a["alert"] for a in alerts()}
    assert names - fires == set(), f"alerts never tested firing: {sorted(names - fires)}"
    assert names - quiet == set(), f"alerts never tested not firing: {sorted(names - quiet)}"
    assert (fires | quiet) - names == set(), "tests name alerts that do not exist"


def test_required_alerts_and_their_annotations() -> None:
    by_name = {a["alert"]: a for a in alerts()}
    required = {"KVWorkerBoundsViolation", "KVWorkerGuardCorruption", "KVServiceSlotsNearlyExhausted",
                "KVServiceAllocationFailures", "KVWorkerDown", "KVServiceStepLatencyHigh"}
    assert required <= set(by_name)
    bv = by_name["KVWorkerBoundsViolation"]
    assert bv["labels"]["severity"] == "critical" and "for" not in bv, "any violation alerts at once"
    for key in ("summary", "description"):
        assert "{{ $labels.kernel }}" in bv["annotations"][key] and "{{ $labels.layer }}" in bv["annotations"][key]
    assert "kvworker_bounds_violations_total" in bv["expr"]
    assert by_name["KVWorkerGuardCorruption"]["labels"]["severity"] == "critical"
    assert 'up{job="kvworker"} == 0' in by_name["KVWorkerDown"]["expr"]
    step = by_name["KVServiceStepLatencyHigh"]["expr"]
    assert "histogram_quantile(0.99" in step and 'method="Step"' in step
    for a in alerts():
        assert a["labels"]["severity"] in {"critical", "warning"}, a["alert"]
        assert {"summary", "description", "runbook"} <= set(a["annotations"]), a["alert"]


def test_every_alert_has_a_runbook_section() -> None:
    doc = OPERATIONS.read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", doc, flags=re.M)}
    for a in alerts():
        path, _, anchor = a["annotations"]["runbook"].partition("#")
        assert path == "docs/operations.md"
        assert anchor == a["alert"].lower() and anchor in anchors, f"no runbook heading for {a['alert']}"


def test_prometheus_rule_is_generated_from_the_rules_file() -> None:
    sync = _sync_rules()
    assert PROMETHEUS_RULE.read_text() == sync.render(), \
        "PrometheusRule is out of date: run python deploy/prometheus/sync_rules.py"
    generated = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert generated["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_prometheus_rule_groups_pass_promtool(tmp_path: Path) -> None:
    spec = yaml.safe_load(PROMETHEUS_RULE.read_text())["spec"]
    f = tmp_path / "from-prometheusrule.yml"
    f.write_text(yaml.safe_dump(spec))
    r = promtool("check", "rules", str(f))
    assert r.returncode == 0, r.stdout + r.stderr


def test_plain_prometheus_config(tmp_path: Path) -> None:
    """promtool check config, including the rule_files it names.

    Debian's prometheus build leaves out Kubernetes service discovery ("field
    kubernetes_sd_configs not found"); there the same config is checked with each
    kubernetes_sd_configs replaced by an empty static_configs, so everything else (relabeling,
    rule files) is still checked.
    """
    config = DEPLOY / "prometheus" / "prometheus.yml"
    r = promtool("check", "config", str(config))
    if r.returncode != 0 and "kubernetes_sd_configs not found" in r.stdout + r.stderr:
        doc = yaml.safe_load(config.read_text())
        for sc in doc["scrape_configs"]:
            assert sc.pop("kubernetes_sd_configs")
            sc["static_configs"] = [{"targets": []}]
        doc["rule_files"] = [str(RULES)]
        alt = tmp_path / "prometheus.yml"
        alt.write_text(yaml.safe_dump(doc))
        r = promtool("check", "config", str(alt))
    assert r.returncode == 0, r.stdout + r.stderr
    doc = yaml.safe_load(config.read_text())
    assert {sc["job_name"] for sc in doc["scrape_configs"]} == {"kvservice-manager", "kvworker"}
    assert (config.parent / doc["rule_files"][0]).resolve() == RULES.resolve()


def test_sync_rules_check_mode() -> None:
    assert _sync_rules().main(["--check"]) == 0
