"""pptrace/export/tables.py: terminal tables that fit any console width without cutting a
value. Rendered into a string by a rich Console of a fixed width; widths worked out by
hand from rich's default box (one border per column plus one, one space of padding on each
side: a table's width is the sum of its columns + 3 per column + 1), then a randomized
check of every promise against a brute-force reference of which columns show and into how
many parts a table splits.
"""
from __future__ import annotations

import io
import itertools
import re

import numpy as np
import pytest
from rich.cells import cell_len
from rich.console import Console

from pptrace.export.tables import Col, is_empty, print_table, printable


def render(width: int, columns, rows, title=None, **kwargs) -> tuple[str, list]:
    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False, highlight=False)
    shown = print_table(console, title, columns, rows, **kwargs)
    return buf.getvalue(), shown


def tables_of(text: str) -> list[list[str]]:
    """The header words of each table printed (one list per part), top to bottom: a part's
    header lines (those with ┃) end at the rule under them."""
    parts, words = [], []
    for line in text.splitlines():
        if "━" in line and set(line) <= set("━╇┡┩ "):
            parts.append(words)
            words = []
        elif "┃" in line:
            words += line.replace("┃", " ").split()
    return parts


def widest_line(text: str) -> int:
    return max((cell_len(line) for line in text.splitlines()), default=0)


# -- the helpers ----------------------------------------------------------------------------
@pytest.mark.parametrize("cell, empty", [
    ("-", True), ("", True), ("   ", True), ("0", True), ("0.00", True), ("0.0%", True), ("+0.0%", True),
    ("-0.0", True), ("0 ms", True), (" 0.000 ms ", True),
    ("0.01", False), ("1 ms", False), ("-0.1%", False), ("nan", False), ("inf", False), ("rank", False),
    ("0x", False), ("pp1 tp0", False),
])
def test_is_empty(cell, empty):
    assert is_empty(cell) is empty


@pytest.mark.parametrize("text, shown", [
    ("rank0.json", "rank0.json"),
    ("µs ≤ ✓", "µs ≤ ✓"),                       # printable Unicode stays
    ("\x1b[2Jgone", "\\x1b[2Jgone"),            # ESC: would clear the screen
    ("a\tb\nc\rd", "a\\x09b\\x0ac\\x0dd"),
    ("\x7f\x85\x9f", "\\x7f\\x85\\x9f"),         # DEL and C1 controls
    ("abc\u202egpj.exe", "abc\\u202egpj.exe"),  # right-to-left override
    ("\u2066x\u2069", "\\u2066x\\u2069"),       # bidi isolates
    ("\u200b", "\u200b"),                       # zero width space is no control: left as is
])
def test_printable(text, shown):
    assert printable(text) == shown


def test_printable_takes_any_value():
    assert printable(3) == "3" and printable(None) == "None"


# -- a table that fits ----------------------------------------------------------------------
COLS = [Col("rank", key=True), Col("time s"), Col("pp bubble")]
ROWS = [["0", "0.034284", "0.005521"], ["1", "0.033197", "0.005470"]]


def test_a_table_that_fits_is_printed_whole():
    text, shown = render(120, COLS, ROWS, title="Per rank", caption="times in s")
    lines = text.splitlines()
    assert lines[0] == "Per rank"
    assert lines[-1] == "times in s"
    assert tables_of(text) == [["rank", "time", "s", "pp", "bubble"]]
    assert shown == ["rank", "time s", "pp bubble"]
    for row in ROWS:
        assert re.search(r"\s+".join(["│", *(re.escape(c) + r" │" for c in row)]), text), row
    # rank(4) + time s(8) + pp bubble(9) + 3 * 3 + 1
    assert widest_line(text) == 4 + 8 + 9 + 3 * 3 + 1


def test_markup_in_cells_and_titles_is_printed_as_written():
    text, _ = render(80, [Col("name", key=True, justify="left"), Col("n")], [["[bold]x[/]", "1"]],
                     title="[red]t", caption="[/] caption")
    assert "[bold]x[/]" in text and text.startswith("[red]t\n") and "[/] caption" in text


# -- columns left out -----------------------------------------------------------------------
def test_zero_columns_are_left_out_and_named():
    cols = [Col("rank", key=True), Col("step", drop_zero=False), Col("compute"), Col("tp exposed"),
            Col("cp exposed"), Col("pp bubble"), Col("note", wrap=True)]
    rows = [["0", "0", "12.5", "0.00", "-", "0.0%", ""],
            ["0", "0", "13.0", "0 ms", "", "+0.0%", "-"]]
    text, shown = render(160, cols, rows)
    # the key and the drop_zero=False column stay though zero
    assert shown == ["rank", "step", "compute"]
    assert tables_of(text) == [["rank", "step", "compute"]]
    assert text.splitlines()[-1] == "zero or none in every row, not shown: tp exposed, cp exposed, pp bubble, note"


def test_one_nonzero_cell_keeps_a_column():
    cols = [Col("rank", key=True), Col("a"), Col("b")]
    text, shown = render(80, cols, [["0", "0", "0"], ["1", "0.001", "0"]])
    assert shown == ["rank", "a"] and "not shown: b" in text


def test_a_table_without_rows_leaves_nothing_out():
    text, shown = render(80, COLS, [])
    assert shown == ["rank", "time s", "pp bubble"] and "not shown" not in text


def test_cells_may_be_any_value():
    text, shown = render(80, COLS, [[0, 0.5, None]])
    assert shown == ["rank", "time s", "pp bubble"]  # "None" is no zero
    assert "0.5" in text and "None" in text


# -- too wide: parts that repeat the keys ---------------------------------------------------
def _numbers(n: int) -> tuple[list, list]:
    """A key rank (width 4) and n columns of width 8 (short headers): a table of c of
    them is 4 + 8c + 3(c + 1) + 1 = 8 + 11c wide."""
    cols = [Col("rank", key=True), *(Col(f"c{i}") for i in range(n))]
    rows = [["0", *(f"0.{i}00001" for i in range(n))], ["1", *(f"1.{i}00001" for i in range(n))]]
    return cols, rows


def test_a_wide_table_splits_into_parts_that_repeat_the_keys():
    cols, rows = _numbers(5)
    # 40 columns hold 2 (30 wide), not 3 (41): five columns in three parts
    text, shown = render(40, cols, rows)
    assert tables_of(text) == [["rank", "c0", "c1"], ["rank", "c2", "c3"], ["rank", "c4"]]
    assert shown == ["rank", *(f"c{i}" for i in range(5))]
    assert widest_line(text) <= 40
    for row in rows:
        for cell in row[1:]:
            assert f" {cell} │" in text
    # one width more and it fits whole: 8 + 11 * 5 = 63
    assert len(tables_of(render(63, cols, rows)[0])) == 1
    assert len(tables_of(render(62, cols, rows)[0])) == 2


def test_parts_are_as_even_as_they_fit():
    cols, rows = _numbers(4)
    # 41 columns hold 3; four split 2 + 2, not 3 + 1
    text, _ = render(41, cols, rows)
    assert tables_of(text) == [["rank", "c0", "c1"], ["rank", "c2", "c3"]]


def test_several_keys_are_repeated_in_every_part():
    cols = [Col("rank", key=True), Col("where", key=True, justify="left"),
            *(Col(f"c{i}") for i in range(3))]
    rows = [["0", "pp0 dp1", "0.100001", "0.200001", "0.300001"]]
    # keys 4 + 7; with one column of 8: 19 + 3 * 3 + 1 = 29; with two: 40
    text, _ = render(39, cols, rows)
    assert tables_of(text) == [["rank", "where", "c0"], ["rank", "where", "c1"], ["rank", "where", "c2"]]
    assert text.count("pp0 dp1") == 3


def test_without_an_edge_a_table_has_two_more_columns():
    cols, rows = _numbers(2)
    # 30 wide with its edge: at 28 it splits, without the edge (whose borders rich leaves
    # out) it fits whole
    assert len(tables_of(render(29, cols, rows)[0])) == 2
    text, _ = render(28, cols, rows, show_edge=False)
    assert tables_of(text) == [["rank", "c0", "c1"]] and widest_line(text) <= 28
    assert text.splitlines()[0].split("┃") == [" rank ", "       c0 ", "       c1 "]
    assert tables_of(render(27, cols, rows, show_edge=False)[0]) == [["rank", "c0"], ["rank", "c1"]]


def test_headers_wrap_at_their_spaces_and_never_inside_a_word():
    cols = [Col("stage", key=True), Col("bubble fraction of the step"), Col("theory bubble fraction")]
    rows = [["0", "41.2%", "43.0%"]]
    text, _ = render(30, cols, rows)
    # stage 5 + "fraction" 8 + "fraction" 8 + 3 * 3 + 1 = 31 > 30: in two parts
    assert len([line for line in text.splitlines() if line.startswith("┏")]) == 2
    words = set(re.split(r"[\s┃│┏┓┳┗┛┻━┡┩╇└┘┴─]+", text))
    assert {"bubble", "fraction", "of", "the", "step", "theory", "41.2%", "43.0%"} <= words
    assert widest_line(text) <= 30


def test_text_columns_wrap_at_spaces():
    cols = [Col("", key=True, justify="left"), Col("configuration", wrap=True, justify="left"), Col("step time")]
    rows = [["measured", "1f1b pp4 vpp1 mb8 straggler on", "12.5 ms"]]
    text, _ = render(40, cols, rows, show_edge=False)
    assert len(tables_of(text)) == 1 and widest_line(text) <= 40
    assert "│ 1f1b pp4 vpp1 mb8 │" in text  # the text wrapped at a space
    assert [line.split("┃")[0] for line in text.splitlines()[:2]] == [" " * 10] * 2  # the key's empty header
    words = set(re.split(r"[\s┃│━╇]+", text))
    assert {"1f1b", "pp4", "vpp1", "mb8", "straggler", "on", "12.5", "measured"} <= words


# -- too narrow for any table: lines ---------------------------------------------------------
def test_a_console_too_narrow_for_any_part_prints_lines():
    cols = [Col("rank", key=True), Col("stage", key=True), Col("wait ms"), Col("transfer")]
    rows = [["0", "1", "123456789012", "0.25"], ["3", "0", "2.5", "0.125"]]
    # keys 4 + 5 and the 12-wide value: 21 + 3 * 3 + 1 = 31 > 30
    text, shown = render(30, cols, rows, title="links", caption="per step")
    assert text.splitlines() == ["links", "rank 0 stage 1", "  wait ms: 123456789012", "  transfer: 0.25",
                                 "rank 3 stage 0", "  wait ms: 2.5", "  transfer: 0.125", "per step"]
    assert shown == ["rank", "stage", "wait ms", "transfer"]


def test_lines_still_name_the_columns_left_out():
    cols = [Col("rank", key=True), Col("wait ms"), Col("zero")]
    text, shown = render(12, cols, [["0", "123456789012", "0"]])
    assert shown == ["rank", "wait ms"]
    assert " ".join(text.split()).endswith("zero or none in every row, not shown: zero")


def test_lines_without_keys_mark_each_row():
    text, _ = render(10, [Col("value")], [["1234567890"]])
    assert text.splitlines() == ["-", "  value: ", "1234567890"]


@pytest.mark.parametrize("key", ["[bold]x", "a[/]"])
def test_lines_print_key_cells_as_written(key):
    text, _ = render(14, [Col("name", key=True), Col("value long header")], [[key, "12345678901"]])
    assert text.splitlines()[0] == f"name {key}"


def test_only_keys_too_wide_print_as_lines():
    text, shown = render(20, [Col("name", key=True), Col("where", key=True), Col("zero")],
                         [["1234567890", "pp1 tp1 dp0", "0"]])
    assert shown == ["name", "where"]
    assert "1234567890" in text and "pp1 tp1 dp0" in text.replace("\n", " ")


# -- randomized, against a brute-force reference ---------------------------------------------
def _ref_layout(cols, rows, budget):
    """(headers kept, number of parts or 0 for lines): the module's rules written out."""
    keep = [i for i, c in enumerate(cols) if c.key or not c.drop_zero or not rows
            or not all(is_empty(r[i]) for r in rows)]
    cols = [cols[i] for i in keep]
    rows = [[r[i] for i in keep] for r in rows]

    def min_width(i):
        head = max(len(w) for w in (cols[i].header.split() or [""]))
        cells = [len(w) for r in rows for w in (r[i].split() or [""])] if cols[i].wrap else [len(r[i]) for r in rows]
        return max([head, *cells])

    def fits(idx):
        return sum(min_width(i) for i in idx) + 3 * len(idx) + 1 <= budget

    keys = [i for i, c in enumerate(cols) if c.key]
    rest = [i for i, c in enumerate(cols) if not c.key]
    if not cols:
        return [], 0  # every column zero: only the line naming them
    if fits(list(range(len(cols)))):
        return [c.header for c in cols], 1
    if not rest or not all(fits(keys + [i]) for i in rest):
        return [c.header for c in cols], 0
    for n in range(2, len(rest) + 1):  # the fewest runs of adjacent columns that each fit
        for cuts in itertools.combinations(range(1, len(rest)), n - 1):
            bounds = [0, *cuts, len(rest)]
            if all(fits(keys + rest[a:b]) for a, b in zip(bounds, bounds[1:])):
                return [c.header for c in cols], n
    raise AssertionError("unreachable: one column a part always fits")


HEADER_WORDS = ["time", "ms", "pp", "bubble", "fraction", "exposed", "theory", "wait", "transfer", "x"]
TEXT_WORDS = ["warmup", "the", "slowest", "rank", "of", "stage", "1f1b", "gpipe", "interleaved"]


def _random_table(rng):
    n_keys = int(rng.integers(0, 3))
    n_cols = int(rng.integers(1, 8))
    cols = [Col(" ".join(rng.choice(HEADER_WORDS, int(rng.integers(1, 3)))) + f" k{i}", key=True)
            for i in range(n_keys)]
    for i in range(n_cols):
        wrap = rng.random() < 0.2
        cols.append(Col(" ".join(rng.choice(HEADER_WORDS, int(rng.integers(1, 4)))) + f" c{i}", wrap=wrap,
                        drop_zero=rng.random() < 0.8))
    rows = []
    zero_col = {j: rng.random() < 0.3 for j in range(len(cols))}
    for _ in range(int(rng.integers(1, 4))):
        row = []
        for j, col in enumerate(cols):
            if col.wrap:
                row.append(" ".join(rng.choice(TEXT_WORDS, int(rng.integers(0, 4)))) or "-")
            elif zero_col[j]:
                row.append(str(rng.choice(["0", "0.00", "-", "0.0%"])))
            else:
                row.append(f"{rng.random() * 10 ** int(rng.integers(0, 5)):.{int(rng.integers(0, 4))}f}")
        rows.append(row)
    return cols, rows


def test_random_tables_against_the_reference():
    rng = np.random.default_rng(22)
    for trial in range(300):
        cols, rows = _random_table(rng)
        width = int(rng.integers(12, 72))
        edge = bool(rng.random() < 0.7)
        headers, parts = _ref_layout(cols, rows, width if edge else width + 2)
        if parts == 0 and headers and all(c.key for c in cols if c.header in headers):
            continue  # keys alone too wide: the crash test_only_keys_too_wide_print_as_lines marks
        text, shown = render(width, cols, rows, show_edge=edge)
        where = (trial, width, edge, [c.header for c in cols], rows)
        assert shown == headers, where
        assert len(tables_of(text)) == parts, where
        assert widest_line(text) <= width, where
        assert "…" not in text, where
        dropped = [c.header for c in cols if c.header not in headers]
        flat = " ".join(text.split())
        if dropped:
            assert "zero or none in every row, not shown: " + ", ".join(dropped) in flat, where
        # every value shown is one unbroken word of the output
        words = set(re.split(r"[\s┃│━╇┡┩┏┓┳└┘┴─:]+", text))
        for row in rows:
            for col, cell in zip(cols, row):
                if col.header in headers:
                    assert set(cell.split()) <= words, (where, cell)
