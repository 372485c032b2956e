"""Read back the tables kvscope prints (rich's default box: ``┃`` header cells, ``│`` body cells), for tests
that check what a terminal of a given width shows: every column's header and cells, and how wide each cell
is."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrintedTable:
    headers: list[str] = field(default_factory=list)
    """Each column's header, its lines joined by a space."""
    rows: list[list[str]] = field(default_factory=list)
    """Each body line's cells, stripped."""
    cell_widths: list[int] = field(default_factory=list)
    """Width of every header and body cell (content and its padding), each line's cells in turn."""


def _cells(line: str, bar: str) -> list[str]:
    return line.strip()[1:-1].split(bar)


def printed_tables(text: str) -> list[PrintedTable]:
    """The tables in ``text``, in order."""
    tables: list[PrintedTable] = []
    header_lines: list[list[str]] = []
    for line in text.splitlines():
        start = line.lstrip()[:1]
        if start == "┏":
            tables.append(PrintedTable())
            header_lines = []
        elif start == "┃":
            cells = _cells(line, "┃")
            header_lines.append([c.strip() for c in cells])
            tables[-1].cell_widths += [len(c) for c in cells]
        elif start == "┡":
            tables[-1].headers = [
                " ".join(p for p in parts if p) for parts in zip(*header_lines, strict=True)
            ]
        elif start == "│":
            cells = _cells(line, "│")
            tables[-1].rows.append([c.strip() for c in cells])
            tables[-1].cell_widths += [len(c) for c in cells]
    return tables
