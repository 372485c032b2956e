"""``kvscope logs report`` and ``logs search`` tables at 80, 100 and 200 columns (issue 45): every line fits
the width, no column is squeezed to nothing, every id is printed whole (a pasted id works in ``logs why``),
and the columns left out are named with the flag that shows them."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
from pathlib import Path

import pytest

from kvscope.common.tables import terminal_width
from kvscope.gateway.analytics import commands
from kvscope.gateway.analytics.cli import logs_main
from kvscope.gateway.analytics.commands import LogSource
from kvscope.gateway.analytics.render import render_records, render_report
from tests.gateway.logs.test_report_files import known_records
from tests.table_text import printed_tables

WIDTHS = (80, 100, 200)


def _ids(i: int) -> tuple[str, str]:
    """A gateway-style request id (32 hex characters, as uuid4().hex) and trace id for record ``i``."""
    return hashlib.md5(f"request {i}".encode()).hexdigest(), hashlib.md5(f"trace {i}".encode()).hexdigest()


@pytest.fixture(scope="module")
def log(tmp_path_factory) -> Path:
    records = known_records()
    for i, record in enumerate(records):
        record["http"]["request"]["id"], record["trace"]["id"] = _ids(i)
    path = tmp_path_factory.mktemp("tables") / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _check(text: str, width: int) -> None:
    """Every line within ``width``; every header and cell at least one character wide (plus its padding)."""
    assert max(len(line) for line in text.splitlines()) <= width
    for table in printed_tables(text):
        assert all(table.headers) and min(table.cell_widths) >= 3


def _report(log: Path, width: int | None) -> str:
    out = io.StringIO()
    render_report(asyncio.run(commands.report(LogSource(str(log)), by="model", top=5)), "table", out, width)
    return out.getvalue()


ROWS_HEADERS = {
    80: ["model", "requests", "errors", "TTFT p99", "e2e p99", "TPOT p99", "TTFT p50", "e2e p50"],
    100: ["model", "requests", "errors", "TTFT p99", "e2e p99", "TPOT p99", "TTFT p50", "e2e p50", "TPOT p50",
          "tokens in/out"],
    200: ["model", "requests", "errors", "TTFT p99", "e2e p99", "TPOT p99", "TTFT p50", "e2e p50", "TPOT p50",
          "TTFT p95", "e2e p95", "TPOT p95", "tokens in/out", "batch mean", "KV p95", "preempt"],
}  # fmt: skip
SLOW_HEADERS = {
    80: ["time (UTC)", "request id", "status", "e2e s", "cause"],
    100: ["time (UTC)", "request id", "status", "e2e s", "ttft s", "queue s", "cause"],
    200: ["time (UTC)", "request id", "trace id", "model", "status", "e2e s", "ttft s", "queue s",
          "prefill s", "decode s", "kv use", "slowest phase", "cause"],
}  # fmt: skip


@pytest.mark.parametrize("width", WIDTHS)
def test_report_fits_the_width_and_prints_ids_whole(log: Path, width: int) -> None:
    text = _report(log, width)
    _check(text, width)
    rows, slow = printed_tables(text)
    assert rows.headers == ROWS_HEADERS[width]
    assert [r[0] for r in rows.rows] == ["all", "qwen3-0.6b", "smollm2-135m", "llama-3-8b"]
    assert slow.headers == SLOW_HEADERS[width]
    slowest = sorted(known_records(), key=lambda r: -r["kvscope"]["e2e_s"])[:5]
    ids = [_ids(known_records().index(r))[0] for r in slowest]
    assert [row[slow.headers.index("request id")] for row in slow.rows] == ids
    assert [len(i) for i in ids] == [32] * 5
    if "trace id" in slow.headers:
        traces = [_ids(known_records().index(r))[1] for r in slowest]
        assert [row[slow.headers.index("trace id")] for row in slow.rows] == traces


def test_the_left_out_columns_are_named(log: Path) -> None:
    lines = _report(log, 80).splitlines()
    assert "1 column left out" not in "\n".join(lines)
    notes = [line for line in lines if "left out to fit 80 columns" in line]
    assert notes[0].startswith("8 columns left out to fit 80 columns: TPOT p50, TTFT p95, e2e p95, TPOT p95,")


def test_wide_keeps_every_column(log: Path) -> None:
    rows, slow = printed_tables(_report(log, None))
    assert len(rows.headers) == 16 and len(slow.headers) == 14


SEARCH_HEADERS = {
    80: ["time (UTC)", "request id", "status", "e2e s"],
    100: ["time (UTC)", "request id", "model", "status", "e2e s", "ttft s"],
    200: ["time (UTC)", "request id", "model", "status", "e2e s", "ttft s", "key", "upstream", "error",
          "trace id"],
}  # fmt: skip


@pytest.mark.parametrize("width", WIDTHS)
def test_search_fits_the_width_and_prints_ids_whole(log: Path, width: int) -> None:
    records = asyncio.run(commands.search(LogSource(str(log)), "", limit=6))
    out = io.StringIO()
    render_records(records, "table", out, width)
    _check(out.getvalue(), width)
    (table,) = printed_tables(out.getvalue())
    assert table.headers == SEARCH_HEADERS[width]
    wanted = [r["http"]["request"]["id"] for r in records]
    assert [row[1] for row in table.rows] == wanted and [len(i) for i in wanted] == [32] * 6
    assert table.rows[0][0] == "01-01 12:06:39"  # month-day and time, UTC


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_cli_fits_the_terminal_and_wide_shows_everything(log: Path, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setenv("TERM", "dumb")  # a terminal without colours: plain text to read back
    assert terminal_width(FakeTerminal()) == 100
    narrow_out, wide_out = FakeTerminal(), FakeTerminal()
    monkeypatch.setattr("sys.stdout", narrow_out)
    assert logs_main(["search", "", "--source", str(log), "--limit", "3"], env={}) == 0
    monkeypatch.setattr("sys.stdout", wide_out)
    assert logs_main(["search", "", "--source", str(log), "--limit", "3", "--wide"], env={}) == 0
    narrow, wide = narrow_out.getvalue(), wide_out.getvalue()
    assert printed_tables(narrow)[0].headers == SEARCH_HEADERS[100]
    assert (
        "4 columns left out to fit 100 columns: key, upstream, error, trace id (--wide shows them)" in narrow
    )
    assert printed_tables(wide)[0].headers == SEARCH_HEADERS[200]
    assert "left out" not in wide


def test_a_pipe_gets_every_column(log: Path, capsys) -> None:
    assert logs_main(["search", "", "--source", str(log), "--limit", "3"], env={}) == 0
    assert printed_tables(capsys.readouterr().out)[0].headers == SEARCH_HEADERS[200]
