"""Alert thresholds read from alerts/kvscope.rules.yaml, so that a panel's threshold line is the number the
alert compares with (the dashboards are generated from the rules; a changed threshold moves the line)."""

from __future__ import annotations

import re
from functools import cache

import yaml

from kvscope.dashboards.coverage import RULES_FILE

_COMPARISON = re.compile(r"(?:>=|<=|>|<)\s*(-?[0-9][0-9.eE+-]*)")


@cache
def _rules() -> tuple[dict, ...]:
    doc = yaml.safe_load(RULES_FILE.read_text())
    return tuple(r for g in doc["groups"] for r in g["rules"] if "alert" in r)


def alert_threshold(alert: str, **labels: str) -> float:
    """The number in the first comparison of ``alert``'s expression (the rule whose static labels include
    ``labels``, e.g. ``severity="critical", long_window="1h"``). Raises KeyError when no rule or more than one
    matches, ValueError when its expression has no comparison with a number."""
    rules = [r for r in _rules() if r["alert"] == alert and labels.items() <= r.get("labels", {}).items()]
    if len(rules) != 1:
        raise KeyError(f"{len(rules)} rules of alert {alert} with labels {labels}")
    match = _COMPARISON.search(rules[0]["expr"])
    if match is None:
        raise ValueError(f"alert {alert} compares with no number: {rules[0]['expr']!r}")
    return float(match.group(1))
