"""Which metric names the shipped Grafana dashboard and Prometheus rules use, and which a ``/metrics`` text
exposes; shared by the unit check (registries) and the end-to-end check (live scrapes)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

OBSERVABILITY = Path(__file__).resolve().parents[2] / "infra" / "observability"
DASHBOARD = OBSERVABILITY / "grafana-dashboard.json"
ALERTS = OBSERVABILITY / "alerts.yml"

_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}
_CLAUSE = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def rule_expressions() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v.get("type") == "query"]
    return exprs


def referenced_metrics(expressions: list[str]) -> set[str]:
    """Series names an expression selects (label matchers, grouping clauses and strings dropped)."""
    names: set[str] = set()
    for expr in expressions:
        bare = re.sub(r'"[^"]*"', "", expr)
        bare = re.sub(r"\{[^}]*\}", "", bare)
        bare = re.sub(r"\[[^\]]*\]", "", bare)
        bare = _CLAUSE.sub("", bare)
        names.update(t for t in _IDENT.findall(bare) if t.startswith(("sluicegate", "gen_ai_")))
    return names


def exposed_names(text: str) -> set[str]:
    """Every series name a ``/metrics`` text declares, including families with no sample yet."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names
