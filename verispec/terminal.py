"""Tables for a terminal of any width: the full rich table where it fits, else one aligned line per row.

Rich fits a table wider than the terminal by folding every cell over several lines ("plai" over "n"), which an
80-column terminal, or output that reaches no terminal (rich assumes 80 columns then, or $COLUMNS), makes
unreadable. There a command prints the columns that matter most instead, one line per row, and leaves the rest to
its report files or to a wider terminal.
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.console import Console
from rich.table import Table
from rich.text import Text

GAP = "  "  # between two columns of the aligned lines
CUT = "…"  # ends a cell cut short to fit the line
UNBOUNDED = 1 << 20  # columns: room for any table at its natural width


def fits(console: Console, table: Table) -> bool:
    """Whether the table prints at its natural width, no cell folded."""
    natural = console.measure(table, options=console.options.update(max_width=UNBOUNDED)).maximum  # not clamped
    return natural <= console.width


def aligned_lines(headers: list[str], rows: list[list[str]], width: int) -> list[str]:
    """A header line and one line per row, each column as wide as its widest cell.

    Figures ("3.3 GiB", "2.23x", "-") are right-aligned, words left-aligned. The last column is cut to what is left
    of `width`, so callers put there what a line can best do without; every other cell is printed whole, since a
    name cut short cannot be typed back."""
    table = [headers, *rows]
    *leading, last = range(len(headers))
    widths = {i: max(len(row[i]) for row in table) for i in leading}
    figures = {i for i in leading if i > 0 and all(_is_figure(row[i]) for row in rows)}  # the first names the row
    lines = []
    for row in table:
        start = "".join((row[i].rjust(widths[i]) if i in figures else row[i].ljust(widths[i])) + GAP for i in leading)
        lines.append((start + _cut(row[last], width - len(start))).rstrip())
    return lines


def _is_figure(cell: str) -> bool:
    return cell in ("", "-") or cell[:1].isdigit()


def _cut(text: str, room: int) -> str:
    """text, or as much of it as fits in `room` characters with CUT at the end."""
    if len(text) <= room:
        return text
    return text[: room - len(CUT)] + CUT if room > len(CUT) else ""


def print_table(
    console: Console, table: Table, headers: list[str], rows: list[list[str]], narrow_notes: Iterable[str] = ()
) -> None:
    """The rich table where the console fits it; else its title, aligned lines of the columns given, and the notes
    that say what those columns leave out (an install command, a reason), wrapped to fit."""
    if fits(console, table):
        console.print(table)
        return
    if table.title:
        print_note(console, str(table.title))
    for line in aligned_lines(headers, rows, console.width):
        console.print(Text(line))
    for note in narrow_notes:
        print_note(console, note)


def print_note(console: Console, text: str) -> None:
    """A line of prose, wrapped at the console's width, printed as it is: a Text, so no markup ("[none]" stays)."""
    console.print(Text(text))
