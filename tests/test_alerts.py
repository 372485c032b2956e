"""Alert rules and Alertmanager config: promtool/amtool accept them, every alert has a firing and a quiet
unit test, mixin conventions (severity, summary, description, runbook_url → an existing runbook), only
defined metrics, SLO thresholds shared with the dashboards, routing and inhibition as designed."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from dashboards import overview
from dashboards.catalog import discover
from dashboards.coverage import rule_queries, undefined
from dashboards.promql import le_regex
from tests.conftest import require_tool

REPO = Path(__file__).resolve().parent.parent
ALERTS = REPO / "alerts"
RULES = ALERTS / "kvscope.rules.yaml"
RULE_TESTS = ALERTS / "kvscope.rules.test.yaml"
ALERTMANAGER = ALERTS / "alertmanager.yml"
RUNBOOKS = REPO / "docs" / "runbooks"
RUNBOOK_BASE = "https://github.com/kvscope/kvscope/blob/main/docs/runbooks/"
REQUIRED = {
    "KvscopeHighP99Latency", "KvscopeHighVRAMUsage", "KvscopeHighErrorRate", "KvscopeTTFTSLOBreach",
    "KvscopeTPOTSLOBreach", "KvscopeQueueBuildup", "KvscopeKVCacheNearFull", "KvscopePreemptionStorm",
    "KvscopeTargetDown", "KvscopeNoHealthyUpstream", "KvscopeUpstreamDown", "KvscopeLogShippingFailing",
    "KvscopeLogSpooling", "KvscopeHighP99TimePerOutputToken", "KvscopeEngineHighErrorRate", "Watchdog",
}
CATALOG = discover()


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=60)


def test_promtool_check_rules() -> None:
    result = run(require_tool("promtool"), "check", "rules", str(RULES))
    assert result.returncode == 0, result.stderr
    assert "SUCCESS: 18 rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = run(require_tool("promtool"), "test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_catch_a_wrong_threshold(tmp_path: Path) -> None:
    # The error-rate warning threshold raised from 1 % to 50 %: the 1.96 % case must no longer fire.
    (tmp_path / "kvscope.rules.yaml").write_text(RULES.read_text().replace("> 0.01\n", "> 0.5\n", 1))
    (tmp_path / "kvscope.rules.test.yaml").write_text(RULE_TESTS.read_text())
    result = run(require_tool("promtool"), "test", "rules", "kvscope.rules.test.yaml", cwd=tmp_path)
    assert result.returncode == 1
    assert "alertname: KvscopeHighErrorRate" in result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    cases = [c for t in yaml.safe_load(RULE_TESTS.read_text())["tests"] for c in t["alert_rule_test"]]
    names = {r["alert"] for r in alert_rules()}
    fires = {c["alertname"] for c in cases if c["exp_alerts"]}
    quiet = {c["alertname"] for c in cases if not c["exp_alerts"]} | {"Watchdog"}  # Watchdog is never quiet
    assert names == REQUIRED
    assert (names - fires, names - quiet) == (set(), set())
    severities = {(c["alertname"], a["exp_labels"]["severity"]) for c in cases for a in c["exp_alerts"]}
    assert {("KvscopeHighErrorRate", "critical"), ("KvscopeHighVRAMUsage", "critical")} <= severities


def test_rules_follow_mixin_conventions() -> None:
    for rule in alert_rules():
        name = rule["alert"]
        assert re.fullmatch(r"(Kvscope)?[A-Z][A-Za-z0-9]+", name), name
        assert rule["labels"]["severity"] in {"critical", "warning", "info", "none"}, name
        assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}, name
        assert rule["annotations"]["runbook_url"] == f"{RUNBOOK_BASE}{name}.md"
        assert (RUNBOOKS / f"{name}.md").is_file(), f"docs/runbooks/{name}.md missing"
        assert rule["annotations"]["summary"].endswith("."), name
        if name != "Watchdog":
            assert "for" in rule, f"{name} fires on a single evaluation"


def test_every_runbook_belongs_to_an_alert_and_has_the_sections() -> None:
    names = {r["alert"] for r in alert_rules()}
    assert {p.stem for p in RUNBOOKS.glob("*.md")} == names
    for path in RUNBOOKS.glob("*.md"):
        text = path.read_text()
        assert text.startswith(f"# {path.stem}\n"), path.name
        for section in ("## Meaning", "## Impact", "## Diagnosis", "## Mitigation"):
            assert section in text, f"{path.name} lacks {section}"


@pytest.mark.parametrize("component", ["engine", "gateway"])
def test_rules_name_only_defined_metrics(component: str) -> None:
    missing = undefined([expr for _, expr in rule_queries(RULES)], CATALOG)
    assert {n for n in missing if n.startswith(f"kvscope_{component}_")} == set()
    assert {n for n in missing if not n.startswith(("kvscope_engine_", "kvscope_gateway_"))} == set()


def test_slo_alerts_use_the_dashboard_thresholds() -> None:
    exprs = {r["alert"]: r["expr"] for r in alert_rules()}
    # p99 latency alerts are length-fair: TTFT and TPOT, never the end-to-end duration
    assert "time_to_first_token_seconds_bucket" in exprs["KvscopeHighP99Latency"]
    assert exprs["KvscopeHighP99Latency"].rstrip().endswith(f"> {overview.TTFT_SLO_S:g}")
    assert "time_per_output_token_seconds_bucket" in exprs["KvscopeHighP99TimePerOutputToken"]
    assert exprs["KvscopeHighP99TimePerOutputToken"].rstrip().endswith(f"> {overview.P99_TPOT_S:g}")
    assert not [n for n, e in exprs.items() if "request_duration_seconds" in e]
    assert f'le=~"{le_regex(overview.TTFT_SLO_S)}"' in exprs["KvscopeTTFTSLOBreach"]
    assert f'le=~"{le_regex(overview.TPOT_SLO_S)}"' in exprs["KvscopeTPOTSLOBreach"]
    for name in ("KvscopeTTFTSLOBreach", "KvscopeTPOTSLOBreach"):
        assert exprs[name].rstrip().endswith(f"< {overview.SLO_OBJECTIVE}")


def test_amtool_check_config() -> None:
    result = run(require_tool("amtool"), "check-config", str(ALERTMANAGER))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout and "2 inhibit rules" in result.stdout


@pytest.mark.parametrize(("labels", "receiver"), [
    (["alertname=KvscopeTargetDown", "severity=critical"], "pager"),
    (["alertname=KvscopeQueueBuildup", "severity=warning"], "team-chat"),
    (["alertname=Watchdog", "severity=none"], "watchdog"),
])
def test_amtool_routes(labels: list[str], receiver: str) -> None:
    result = run(require_tool("amtool"), "config", "routes", "test", f"--config.file={ALERTMANAGER}", *labels)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == receiver


def test_critical_inhibits_warning_of_the_same_alert() -> None:
    config = yaml.safe_load(ALERTMANAGER.read_text())
    first = config["inhibit_rules"][0]
    assert (first["source_matchers"], first["target_matchers"]) == (['severity = "critical"'],
                                                                    ['severity = "warning"'])
    assert "alertname" in first["equal"]
    assert [c["url"] for r in config["receivers"] for c in r["webhook_configs"]] == [
        "http://127.0.0.1:5001/team-chat", "http://127.0.0.1:5001/pager", "http://127.0.0.1:5001/watchdog"]
