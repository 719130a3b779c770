"""The markdown tables of the GPU summaries, in one place: ci/gpu/summarize.py
(the kernel-level results of run.sh), ci/gpu/engine/summarize.py (the
engine campaign's tables.md) and ci/gpu/engine/driver.py (each call's
table) write every table with `md_table`, and format numbers with these
helpers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class _Blank:
    def __str__(self) -> str:
        return ""


BLANK = _Blank()  # a cell left empty: "| |" (a value formatted as "" is "|  |")


def md_row(cells: Sequence[object]) -> str:
    """One line of a table: each cell as an f-string writes it, a space
    either side; BLANK is a cell left empty."""
    return "|" + "".join(" |" if c is BLANK else f" {c} |" for c in cells)


def md_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """The header line, the separator line, then one line per row."""
    return [md_row(header), "|" + "---|" * len(header), *map(md_row, rows)]


def fmt(x: object, nd: int = 2, unit: str = "") -> str:
    """A float to `nd` decimals (other values as they are), "-" for None."""
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}{unit}"
    return f"{x}{unit}"


def fmt_f(x: float | None, spec: str = ".2f") -> str:
    """A number in `spec` (".2e", ".3f", ...), "" for None."""
    return "" if x is None else format(x, spec)
