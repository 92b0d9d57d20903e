#!/usr/bin/env python3
"""Generate the Prometheus-operator PrometheusRule from the one rules source of truth.

    python deploy/prometheus/sync_rules.py           # rewrite the PrometheusRule
    python deploy/prometheus/sync_rules.py --check   # exit 1 if it is out of date

Source: deploy/prometheus/rules/kvservice.rules.yml (plain Prometheus `rule_files` format).
Target: deploy/components/prometheus-operator/prometheusrule.yaml (spec.groups = the same groups).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parent.parent
RULES = DEPLOY / "prometheus" / "rules" / "kvservice.rules.yml"
PROMETHEUS_RULE = DEPLOY / "components" / "prometheus-operator" / "prometheusrule.yaml"

HEADER = """\
# GENERATED from deploy/prometheus/rules/kvservice.rules.yml by deploy/prometheus/sync_rules.py.
# Do not edit: change the rules file and run `python deploy/prometheus/sync_rules.py`.
"""


class _Dumper(yaml.SafeDumper):
    """Block scalars for multi-line strings (PromQL), keys in source order."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render(rules_text: str | None = None) -> str:
    """The PrometheusRule document for the given rules file text (default: the file on disk)."""
    doc = yaml.safe_load(rules_text if rules_text is not None else RULES.read_text())
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "kvservice",
            "labels": {"app.kubernetes.io/name": "kvservice", "app.kubernetes.io/component": "alerting"},
        },
        "spec": {"groups": doc["groups"]},
    }
    return HEADER + yaml.dump(rule, Dumper=_Dumper, sort_keys=False, width=1000, allow_unicode=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the PrometheusRule is out of date")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = PROMETHEUS_RULE.read_text() if PROMETHEUS_RULE.exists() else ""
        if current != text:
            print(f"{PROMETHEUS_RULE} is out of date: run python {Path(__file__).relative_to(DEPLOY.parent)}",
                  file=sys.stderr)
            return 1
        return 0
    PROMETHEUS_RULE.write_text(text)
    print(f"wrote {PROMETHEUS_RULE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
