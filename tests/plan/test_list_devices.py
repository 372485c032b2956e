"""``kvscope plan --list-devices`` at 80, 100 and 200 columns (issue 45): one line per device, the names one
types after ``--device`` printed whole, no column squeezed to nothing; ``--wide`` and ``--format json`` have
the rest."""

from __future__ import annotations

import io

import pytest

from kvscope.cli.plan import plan_main
from kvscope.plan.devices import load_devices
from kvscope.plan.render import print_devices
from tests.table_text import printed_tables

NAMES = list(load_devices())
HEADERS = {
    80: ["name", "memory", "GB/s", "bf16 TFLOP/s", "fp8 TFLOP/s", "int8 TOP/s"],
    100: ["name", "memory", "GB/s", "bf16 TFLOP/s", "fp8 TFLOP/s", "int8 TOP/s", "aliases"],
    200: ["name", "memory", "GB/s", "bf16 TFLOP/s", "fp8 TFLOP/s", "int8 TOP/s", "aliases", "vendor"],
}


@pytest.mark.parametrize("width", [80, 100, 200])
def test_one_line_per_device_with_whole_names(width: int) -> None:
    out = io.StringIO()
    print_devices(out, width)
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= width
    (table,) = printed_tables(text)
    assert table.headers == HEADERS[width]
    assert min(table.cell_widths) >= 3
    assert [row[0] for row in table.rows] == NAMES  # one body line per device: nothing wraps
    assert len(NAMES) == 10
    memory = {row[0]: row[1] for row in table.rows}
    assert (memory["a100-sxm-80gb"], memory["a100-sxm-40gb"]) == ("80 GiB", "40 GiB")
    if "aliases" in table.headers:
        assert table.rows[0][6] == "h100, h100-80gb, h100-sxm"
    left_out = [h for h in ("aliases", "vendor", "source") if h not in table.headers]
    note = f"left out to fit {width} columns: {', '.join(left_out)} (--wide or --format json shows them)"
    assert (note in " ".join(text.split())) is bool(left_out)  # the note may wrap at the width


def test_wide_has_the_sources(capsys) -> None:
    assert plan_main(["--list-devices", "--wide"]) == 0  # capsys is not a terminal: every column anyway
    (table,) = printed_tables(capsys.readouterr().out)
    assert table.headers[-1] == "source" and all(
        row[-1].startswith("NVIDIA") or "AMD" in row[-1] for row in table.rows
    )
