"""Tables that fit the terminal, as ``kubectl get`` and ``docker ps`` do: every cell on one line, whole (an id
is never cut or wrapped), and when the columns do not fit the terminal's width the lowest-priority columns are
left out (a note names them and the flag that shows them), never squeezed to zero width.

A column's priority is a small integer: 0 is always shown; the others are dropped highest number first (ties:
the rightmost first) until the rest fit. ``width=None`` (``--wide``, or output that is not a terminal: a pipe
or a file) keeps every column. When even the priority-0 columns are wider than the terminal, the table is
printed at its own width and the terminal wraps the lines; no cell is cut.

The width of a rendered table with rich's default box and padding is ``sum(w) + 3 * n + 1`` for ``n`` columns
of content widths ``w`` (a border, a space either side of each cell, a border between and after cells).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Literal

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

Justify = Literal["left", "right"]


@dataclass(frozen=True, slots=True)
class Column:
    """One table column: its header (``\\n`` splits it over two lines), priority and alignment."""

    header: str
    priority: int = 0
    """0: always shown; larger numbers are left out first when the table is too wide."""
    justify: Justify = "left"


def content_width(column: Column, cells: Sequence[str]) -> int:
    """Terminal cells the column needs: its widest header line or cell (``rich.cells.cell_len``)."""
    return max([cell_len(line) for line in column.header.split("\n")] + [cell_len(c) for c in cells])


def table_width(widths: Sequence[int]) -> int:
    """Total width of a table of these content widths (module doc), 0 for no columns."""
    return sum(widths) + 3 * len(widths) + 1 if widths else 0


def fit_columns(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int | None) -> list[int]:
    """Indices of the columns shown at ``width`` terminal cells (all of them for ``None``), in order."""
    widths = [content_width(c, [row[i] for row in rows]) for i, c in enumerate(columns)]
    kept = list(range(len(columns)))
    if width is None:
        return kept
    while table_width([widths[i] for i in kept]) > width:
        droppable = [i for i in kept if columns[i].priority > 0]
        if not droppable:
            break
        kept.remove(max(droppable, key=lambda i: (columns[i].priority, i)))
    return kept


def terminal_width(out: IO[str]) -> int | None:
    """The width of ``out`` when it is a terminal (``shutil.get_terminal_size``: ``$COLUMNS``, else the
    terminal's size); None for a pipe or a file, which get every column."""
    isatty = getattr(out, "isatty", None)
    return shutil.get_terminal_size().columns if callable(isatty) and isatty() else None


def fixed_console(out: IO[str], width: int) -> Console:
    """A rich console writing ``width`` cells wide to ``out`` (no highlighting of numbers). Its height is
    given too: rich ignores a width it is given on a dumb terminal (``TERM=dumb``) unless both are."""
    return Console(file=out, width=width, height=25, highlight=False)


def print_table(
    out: IO[str],
    title: str | None,
    columns: Sequence[Column],
    rows: Sequence[Sequence[str]],
    width: int | None,
    *,
    more: str = "--wide",
) -> list[str]:
    """Print the fitted table to ``out`` and, when columns were left out, one line naming them and ``more``
    (the flag that shows them). Cells are plain text (no rich markup). Returns the headers left out."""
    kept = fit_columns(columns, rows, width)
    table = Table(title=title, title_justify="left")
    for i in kept:
        cells = [row[i] for row in rows]
        need = content_width(columns[i], cells)
        table.add_column(
            Text(columns[i].header),
            justify=columns[i].justify,
            no_wrap=True,
            min_width=need,
            overflow="ellipsis",
        )
    for row in rows:
        table.add_row(*(Text(row[i]) for i in kept))
    need = table_width([content_width(columns[i], [r[i] for r in rows]) for i in kept])
    console = fixed_console(out, max(need, width or 0))
    console.print(table)
    dropped = [columns[i].header.replace("\n", " ") for i in range(len(columns)) if i not in kept]
    if dropped:
        count = f"{len(dropped)} column{'s' if len(dropped) > 1 else ''}"
        note = f"{count} left out to fit {width} columns: {', '.join(dropped)}"
        note += f" ({more} shows them)"
        console.print(Text(note), width=width)
    return dropped
