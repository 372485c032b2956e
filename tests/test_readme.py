"""What the README promises a new user (issue 45): what ``docker compose`` needs (the plugin, no daemon for
``config``, the memory the containers' limits add up to, as compose.yaml sets them), and a commands table
with every ``kvscope`` command, ``logs why`` with the ids it takes and ``--version``."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from kvscope.cli.main import COMMANDS

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text(encoding="utf-8")
GIB = 1 << 30


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return " ".join(README[start : end if end > 0 else None].split())


def _bytes(limit: str) -> int:
    """``4g`` → 4 GiB, ``512m`` → 512 MiB (compose's memory limits: tests/test_compose.py checks the form)."""
    return int(limit[:-1]) << (30 if limit[-1] == "g" else 20)


def _limits() -> dict[str, int]:
    services = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    return {name: _bytes(s["deploy"]["resources"]["limits"]["memory"]) for name, s in services.items()}


def test_the_readme_says_what_the_compose_stack_needs() -> None:
    text = _section("The whole stack")
    assert "It needs Docker Engine with the Compose v2 plugin" in text
    assert "install the `docker-compose-plugin` package" in text
    assert "`docker compose config` only reads the files: it needs the plugin but no running daemon." in text
    assert (
        "about 10 GiB of memory for the containers' limits (engine 4 GiB, Elasticsearch 2 GiB, Prometheus "
        "and Kibana 1 GiB each, the rest 0.5 GiB or less)" in text
    )
    limits = _limits()
    assert (limits["engine"], limits["elasticsearch"]) == (4 * GIB, 2 * GIB)
    assert (limits["prometheus"], limits["kibana"]) == (GIB, GIB)
    named = {"engine", "elasticsearch", "prometheus", "kibana"}
    assert max(v for k, v in limits.items() if k not in named) == GIB // 2
    assert round(sum(limits.values()) / GIB) == 10  # 10.0 GiB with the one-shot setup jobs


def test_the_commands_table_has_every_command_logs_why_and_version() -> None:
    rows = [line for line in README.splitlines() if line.startswith("| `kvscope")]
    listed = {name for row in rows for name in re.findall(r"^\| `kvscope (\w+)", row)}
    assert listed == set(COMMANDS)
    why = next(row for row in rows if row.startswith("| `kvscope logs why ID`"))
    assert "the response id (`chatcmpl-…`), `x-request-id`, trace id, or a unique prefix" in why
    assert any(row.startswith("| `kvscope --version`") for row in rows)
