"""Terminal tables that never cut a value, at any console width.

Rich shrinks a table wider than the console by cutting cells ("455.…"): a number shown that
way is a wrong number. Here a table is fitted before rich sees it:

1. a column whose every cell is zero or missing is left out, and a line under the table
   names it (nothing is lost);
2. headers wrap at their spaces, so a column is as wide as its widest value (or longest
   header word); text columns that may wrap wrap at spaces too;
3. a table still too wide is split into parts that repeat the key columns (rank, stage...);
4. where not even one column fits beside the keys, each row is printed as lines of
   ``header: value``.

Whatever prints a table (the analysis, the what-if) goes through :func:`print_table`.
"""
from __future__ import annotations

from dataclasses import dataclass

from rich.cells import cell_len

# rich's default box: one border per column plus one, and one space of padding on each side
_BORDER, _PADDING = 1, 2

#: Characters a terminal acts on instead of showing: C0 and C1 controls (ESC starts the
#: sequences that clear a screen or retitle a window), DEL, and the bidi overrides and
#: isolates that reorder what follows them. A file or event name holding one is shown
#: with the character written out (\x1b), as Python's repr would.
_UNPRINTABLE = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7f, 0xa0))}
_UNPRINTABLE.update({c: f"\\u{c:04x}" for c in (*range(0x202a, 0x202f), *range(0x2066, 0x206a))})


def printable(text) -> str:
    """``text`` safe to print to a terminal: see :data:`_UNPRINTABLE`."""
    return str(text).translate(_UNPRINTABLE)


@dataclass(frozen=True)
class Col:
    header: str
    #: identifies a row: kept in every part of a split table, never left out
    key: bool = False
    #: free text that may wrap at its spaces (values never wrap: a number is one word)
    wrap: bool = False
    #: may be left out when every cell is zero or "-" (named under the table)
    drop_zero: bool = True
    justify: str = "right"


def is_empty(cell: str) -> bool:
    """Zero or missing as printed: "-", "", "0", "0.00", "0.0%", "+0.0%", "0 ms"."""
    text = cell.strip().removesuffix("%").removesuffix(" ms").strip()
    if text in ("", "-"):
        return True
    try:
        return float(text) == 0
    except ValueError:
        return False


def _words(text: str) -> list[str]:
    return text.split() or [""]


def _min_width(col: Col, cells: list[str]) -> int:
    widest_word = max(cell_len(w) for w in _words(col.header))
    if col.wrap:
        return max([widest_word, *(cell_len(w) for c in cells for w in _words(c))])
    return max([widest_word, *(cell_len(c) for c in cells)])


def _natural_width(col: Col, cells: list[str]) -> int:
    return max([cell_len(col.header), *(cell_len(c) for c in cells)])


def _table_width(widths) -> int:
    return sum(widths) + _PADDING * len(widths) + _BORDER * (len(widths) + 1)


def _fit(cols, rows, width: int):
    """Column widths within ``width`` (each at least its minimum), or None if the minimums
    do not fit. Spare room goes first to text that would wrap, then to wrapped headers."""
    cells = [[row[i] for row in rows] for i in range(len(cols))]
    low = [_min_width(c, cs) for c, cs in zip(cols, cells)]
    high = [_natural_width(c, cs) for c, cs in zip(cols, cells)]
    if _table_width(low) > width:
        return None
    widths = list(low)
    spare = width - _table_width(widths)
    for text_first in (True, False):
        for i, col in enumerate(cols):
            if col.wrap == text_first and spare > 0:
                grow = min(high[i] - widths[i], spare)
                widths[i] += grow
                spare -= grow
    return widths


def _parts(cols, rows, width: int):
    """Split the non-key columns into as few groups as fit beside the key columns, as even
    as they fit: a list of column-index lists, or None when one column alone does not fit."""
    keys = [i for i, c in enumerate(cols) if c.key]
    rest = [i for i, c in enumerate(cols) if not c.key]

    def fits(group):
        idx = keys + group
        return _fit([cols[j] for j in idx], [[r[j] for j in idx] for r in rows], width) is not None

    if not rest:
        return [keys] if fits([]) else None
    if not all(fits([i]) for i in rest):
        return None
    for n in range(2, len(rest) + 1):
        # the same number of columns in each part where that fits, else the greedy split
        size = -(-len(rest) // n)
        even = [rest[k:k + size] for k in range(0, len(rest), size)]
        if len(even) == n and all(fits(g) for g in even):
            return [keys + g for g in even]
        greedy, current = [], []
        for i in rest:
            if current and not fits(current + [i]):
                greedy.append(current)
                current = []
            current.append(i)
        greedy.append(current)
        if len(greedy) == n:
            return [keys + g for g in greedy]
    return [keys + [i] for i in rest]


def print_table(console, title: str | None, columns: list[Col], rows: list[list[str]], *,
                caption: str | None = None, show_edge: bool = True) -> list[str]:
    """Print ``rows`` (cells already formatted) under ``columns`` within the console's width,
    never cutting a cell (see the module docstring); returns the headers shown."""
    from rich.markup import escape
    from rich.table import Table

    rows = [[str(c) for c in row] for row in rows]
    keep = [i for i, col in enumerate(columns)
            if col.key or not col.drop_zero or not rows or not all(is_empty(r[i]) for r in rows)]
    left_out = [columns[i].header for i in range(len(columns)) if i not in keep]
    cols = [columns[i] for i in keep]
    rows = [[r[i] for i in keep] for r in rows]
    notes = [caption] if caption else []
    if left_out:
        notes.append("zero or none in every row, not shown: " + ", ".join(left_out))
    width = console.width
    # without an edge the outer borders are spaces rich leaves out
    budget = width if show_edge else width + 2 * _BORDER

    whole = _fit(cols, rows, budget) if cols else None
    parts = [list(range(len(cols)))] if whole else _parts(cols, rows, budget) if cols else []
    if parts is None:
        _print_as_lines(console, title, cols, rows, notes)
        return [c.header for c in cols]
    # the title and notes go on lines of their own at the console's width: inside a table
    # narrower than them they would wrap into a column of words
    if title:
        console.print(f"[bold]{escape(title)}[/]", highlight=False)
    for part in parts:
        pc = [cols[i] for i in part]
        pr = [[r[i] for i in part] for r in rows]
        table = Table(show_edge=show_edge)
        for col, w in zip(pc, _fit(pc, pr, budget)):
            # a width at least the widest value: only headers and text wrap, at their spaces
            table.add_column(escape(col.header), justify=col.justify, width=w)
        for row in pr:
            table.add_row(*(escape(c) for c in row))
        console.print(table)
    for note in notes:
        console.print(escape(note), highlight=False)
    return [c.header for c in cols]


def _print_as_lines(console, title, cols, rows, notes) -> None:
    """A console too narrow for any table: each row as ``header: value`` lines."""
    from rich.markup import escape

    if title:
        console.print(f"[bold]{escape(title)}[/]")
    keys = [i for i, c in enumerate(cols) if c.key]
    for row in rows:
        console.print(escape(" ".join(f"{cols[i].header} {row[i]}" for i in keys)) or "-", highlight=False)
        for i, col in enumerate(cols):
            if not col.key:
                console.print(f"  {escape(col.header)}: {escape(row[i])}", highlight=False)
    for note in notes:
        console.print(escape(note), highlight=False)
