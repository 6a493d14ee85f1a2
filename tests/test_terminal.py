"""What commands print in a narrow terminal: aligned lines that fit, cut only where a line can do without."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from verispec.terminal import aligned_lines, fits


def test_aligned_lines_right_align_figures_and_cut_only_the_last_column():
    lines = aligned_lines(["mode", "tok/s", "drafter"],
                          [["plain", "23.75", "-"], ["composite-auto", "3.5", "suffix index, then draft head"]], 40)
    assert lines == [
        "mode            tok/s  drafter",
        "plain           23.75  -",
        "composite-auto    3.5  suffix index, th…",  # 40 columns: the drafter gives way, the names never do
    ]
    assert aligned_lines(["name", "cached"], [["a", "yes"], ["bb", "no"]], 80) == ["name  cached", "a     yes",
                                                                                    "bb    no"]  # words: left


def test_a_table_fits_only_where_no_cell_would_fold():
    table = Table(title="a title")
    for column in ("mode", "speedup (geomean, 95% CI)"):
        table.add_column(column)
    table.add_row("composite-auto", "2.23x [2.10, 2.40]")
    natural = Console(width=200).measure(table).maximum
    assert fits(Console(width=natural), table) and not fits(Console(width=natural - 1), table)
