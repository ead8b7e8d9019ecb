"""Reading what an exporter serves, and the metric names the examples' dashboard and alert rules
use (tests/ops/test_exporter.py, tests/visibility/test_exporter.py)."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

#: A sample: metric name and its labels (sorted pairs).
Sample = tuple[str, tuple[tuple[str, str], ...]]

#: A metric name in a PromQL expression.
METRIC = re.compile(r"\b(singletask_[a-z_]+)\b")
#: The sample names each family type exposes, from its family name.
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def samples_of(text: str) -> dict[Sample, float]:
    """Every sample of an exposition text, by name and labels."""
    found: dict[Sample, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def value(samples: dict[Sample, float], name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def exposed_names(text: str) -> set[str]:
    """Every sample name ``/metrics`` can show: its samples', and those its families' types
    give (a family with no sample now, such as a gauge of locks when none is held, is still
    served, as its HELP and TYPE lines)."""
    names = {name for name, _ in samples_of(text)}
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    return names


def names_in_examples() -> dict[str, set[str]]:
    """The metric names the dashboard's panels and variables and the alert rules use, per
    file."""
    dashboard = json.loads((EXAMPLES / "grafana_dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"]
             for target in panel.get("targets", ())]  # fmt: skip
    exprs += [variable["definition"] for variable in dashboard["templating"]["list"]]
    rules = yaml.safe_load((EXAMPLES / "prometheus_alerts.yml").read_text())
    alerts = [str(rule["expr"]) for group in rules["groups"] for rule in group["rules"]]
    return {
        "grafana_dashboard.json": {m for expr in exprs for m in METRIC.findall(expr)},
        "prometheus_alerts.yml": {m for expr in alerts for m in METRIC.findall(expr)},
    }


def scrape_text(url: str) -> str:
    """What ``url`` (an exporter's /metrics) serves now."""
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())
