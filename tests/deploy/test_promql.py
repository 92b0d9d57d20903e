"""Every PromQL expression of the dashboard and the alert rules parses (promtool, as recording
rules) and names only series the services export (docs/DESIGN.md's list, plus `up`); the manager's
part of that list is also checked against a live /metrics scrape."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from .support import (
    CLIENT_METRICS,
    COMING,
    DASHBOARD,
    KNOWN_SERIES,
    MANAGER_METRICS,
    REPLICATED_METRICS,
    RULES,
    WORKER_METRICS,
    need,
    sample_names,
)

KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
            "offset", "inf", "nan", "atan2", "start", "end",
            # aggregation operators may be followed by a grouping clause instead of "("
            "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
            "quantile", "limitk", "limit_ratio"}
#: Grafana's built-in interval variables, replaced by a duration before parsing.
GRAFANA_INTERVALS = re.compile(r"\$(__rate_interval|__interval|__range|__auto_interval_\w+)|\$\{__\w+\}")
GRAFANA_VARS = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers outside strings, label matchers, grouping
    clauses and durations that are not functions, keywords or aggregations."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)   # strings
    names: set[str] = set()
    s = re.sub(r"\{[^{}]*\}", " ", s)                                               # label matchers
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", r" \1 ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)                                               # ranges, subqueries
    s = re.sub(r"\boffset\s+-?\w+", " ", s)
    s = re.sub(r"@\s*[\w.()]+", " ", s)
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", s):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in KEYWORDS or re.fullmatch(r"\d+\w*", word):
            continue
        names.add(word)
    return names


def test_metric_name_extraction() -> None:
    e = ('sum by (job, instance, pool) (rate(kvservice_alloc_failures_total{pool=~"a|b",x="sum(y)"}[5m])) '
         '/ on (job) group_left sum(rate(kvservice_rpc_duration_seconds_count{method="Step"}[5m] offset 1h)) > 0.05 '
         'or absent(up{job="kvworker"}) unless kvworker_cache_bytes @ 1609746000 and vector(1) > bool 2e3')
    assert metric_names(e) == {"kvservice_alloc_failures_total", "kvservice_rpc_duration_seconds_count", "up",
                               "kvworker_cache_bytes"}
    assert metric_names('histogram_quantile(0.99, sum by (le) (rate(x_bucket{method="Step"}[$__rate_interval])))'
                        ) == {"x_bucket"}


def dashboard_exprs() -> dict[str, str]:
    """Panel title/refId -> PromQL, and the template variables' label_values() selectors."""
    dash = json.loads(DASHBOARD.read_text())
    out: dict[str, str] = {}

    def walk(panels: list[dict]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out[f"panel '{p['title']}' {t['refId']}"] = t["expr"]
            walk(p.get("panels", []))

    walk(dash["panels"])
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", q.strip())
            out[f"variable {var['name']}"] = m.group(1) if m else q
    return out


def grafana_to_promql(expr: str) -> str:
    return GRAFANA_VARS.sub(".*", GRAFANA_INTERVALS.sub("5m", expr))


def rule_exprs() -> dict[str, str]:
    return {f"rule {r.get('alert') or r.get('record')}": r["expr"]
            for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}


def all_exprs() -> dict[str, str]:
    return {**{k: grafana_to_promql(v) for k, v in dashboard_exprs().items()}, **rule_exprs()}


def test_dashboard_covers_what_operators_need() -> None:
    exprs = " ".join(dashboard_exprs().values())
    for name in ("kvservice_slots_total", "kvservice_slots_free", "kvservice_alloc_failures_total",
                 "kvservice_prefix_cache_hits_total", "kvservice_rpc_duration_seconds_bucket",
                 "kvworker_bounds_violations_total", "kvworker_guard_corruptions_total",
                 "kvworker_kernel_duration_seconds_bucket", 'up{job="kvworker"}'):
        assert name in exprs, f"dashboard has no panel on {name}"
    assert "histogram_quantile(0.5," in exprs and "histogram_quantile(0.99," in exprs
    assert "sum by (kernel, layer" in exprs
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] == "kvservice"


def test_every_expression_parses(tmp_path: Path) -> None:
    exprs = all_exprs()
    rules = [{"record": f"kvservice_check:expr{i}", "expr": e} for i, e in enumerate(exprs.values())]
    f = tmp_path / "exprs.rules.yml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "parse-check", "rules": rules}]}))
    r = subprocess.run([need("promtool"), "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        bad = re.findall(r"expr(\d+)", r.stdout + r.stderr)
        names = [list(exprs)[int(i)] for i in bad if int(i) < len(exprs)]
        pytest.fail(f"promtool rejects {names}:\n{r.stdout}{r.stderr}")
    assert f"SUCCESS: {len(rules)} rules found" in r.stdout


def test_only_exported_metrics_are_referenced() -> None:
    unknown = {where: sorted(metric_names(e) - KNOWN_SERIES) for where, e in all_exprs().items()}
    unknown = {k: v for k, v in unknown.items() if v}
    assert not unknown, f"names no service exports (docs/DESIGN.md 'Metric names'): {unknown}"


def _scrape_names(text: str) -> set[str]:
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.mark.integration
def test_manager_exports_what_dashboards_and_alerts_use(start_manager) -> None:
    from kvservice.client import BlockManagerClient, ClientError

    manager = start_manager()
    with BlockManagerClient(manager.grpc_addr, timeout=5.0) as c:
        c.wait_ready(10)
        c.step("default", admit=[1, 2], admit_tokens=[100, 10])
        with pytest.raises(ClientError):      # 16 slots, 8 taken: 200 tokens more cannot fit
            c.step("default", admit=[3, 4], admit_tokens=[100, 100])
    live = _scrape_names(manager.metrics())
    expected = sample_names({k: v for k, v in MANAGER_METRICS.items() if k not in COMING})
    assert expected <= live, f"the manager does not export {sorted(expected - live)}"
    referenced = {n for e in all_exprs().values() for n in metric_names(e) if n.startswith("kvservice_")}
    missing = referenced - live - sample_names({k: MANAGER_METRICS[k] for k in COMING}) - sample_names(
        REPLICATED_METRICS) - sample_names(CLIENT_METRICS)
    assert not missing, f"dashboards/alerts use manager series it does not export: {sorted(missing)}"


def test_a_client_given_a_registry_exports_the_client_series() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from kvservice.client import BlockManagerClient

    registry = CollectorRegistry()
    BlockManagerClient("127.0.0.1:1", registry=registry).close()
    assert sample_names(CLIENT_METRICS) <= _scrape_names(generate_latest(registry).decode())


@pytest.mark.integration
def test_worker_exports_what_dashboards_and_alerts_use(start_manager, start_worker) -> None:
    pytest.importorskip("kvservice.worker.server", reason="worker service not built yet (issue 4)")
    import numpy as np

    from kvservice.client.worker_client import WorkerClient
    from kvservice.contract.pagetable import PageTable

    worker = start_worker(start_manager())
    with WorkerClient(worker.grpc_addr, timeout=10.0) as w:
        rep = w.validate(1, PageTable(np.array([0, 2], np.int32), np.array([3, 99], np.int32),
                                      np.array([5], np.int32)))
        assert not rep.ok
        w.corrupt_guard(sorted(w.info().buffers)[0])
        assert not w.check_guards().ok
    live = _scrape_names(worker.metrics())
    assert sample_names(WORKER_METRICS) <= live, sorted(sample_names(WORKER_METRICS) - live)
    referenced = {n for e in all_exprs().values() for n in metric_names(e) if n.startswith("kvworker_")}
    assert referenced <= live
