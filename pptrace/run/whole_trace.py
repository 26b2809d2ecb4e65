"""Traces without ``ProfilerStep#N`` ranges (a benchmark traced with a bare
``torch.profiler.profile()`` block, no ``prof.step()``): each rank's whole trace is analysed
as one step, step 0, as HTA analyses a trace without steps (it warns and keeps every event).

The step is made the way a profiled one is: every row of the rank gets step 0 and the rank
gets one ``ProfilerStep#0`` mark on its main thread spanning that thread's events, so the
one definition of step windows (timeline/windows.py) reads it as it reads a real mark: the
host step is the mark, a GPU rank's step the span of its GPU activity, the pipeline window
the span of the pipeline's ops. A run where only some ranks marked steps is analysed whole
on every rank: cross-rank results (p2p pairs, collectives, the pipeline window) need the
same steps everywhere, and the unmarked ranks cannot be cut into the others' steps without
guessing. A rank whose marks were dropped as corrupt (``dropped_steps``) is not a trace
without prof.step(): such a run is refused as before (build._check_steps).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

#: the step a whole trace becomes
WHOLE_STEP = 0
WHOLE_MARK = f"ProfilerStep#{WHOLE_STEP}"
#: columns a mark keeps from the rank's first main-thread row (where it ran); the rest are
#: set, or empty as in a real ProfilerStep row
_KEPT = ("rank", "lane", "lane_kind", "pid", "tid")


def unmarked_ranks(metas: dict) -> list:
    """The ranks of a run whose traces hold no ProfilerStep#N range at all; [] where some
    rank's marks were dropped as corrupt (that run is refused, not analysed whole)."""
    if any(m.get("dropped_steps") and not m.get("profiler_steps") for m in metas.values()):
        return []
    return sorted(r for r, m in metas.items() if not m.get("profiler_steps"))


def as_one_step(events: pd.DataFrame, metas: dict) -> tuple:
    """-> (events, metas, line): ``events`` with every rank's whole trace as step 0 where
    some rank has no ProfilerStep#N range, ``metas`` saying so (profiler_steps [0]), and the
    warning that says it (None, and both unchanged, where every rank marked its steps)."""
    bare = unmarked_ranks(metas)
    if not bare:
        return events, metas, None
    marked = sorted(set(metas) - set(bare))
    steps = sorted(set().union(*(metas[r]["profiler_steps"] for r in marked)))
    if marked:  # their marks set aside: one step everywhere, the mark made below
        events = events[(events["category"] != "step").to_numpy()]
    events = _with_marks(events)
    metas = {r: {**m, "profiler_steps": [WHOLE_STEP]} for r, m in metas.items()}
    line = (f"ranks {bare[:8]} have no ProfilerStep#N range (traced without prof.step()): "
            f"the whole trace of {'each' if not marked else 'every rank'} is analysed as one step, step {WHOLE_STEP}, "
            "as HTA does; its numbers are those of the whole profiled span, not of one iteration")
    if marked:
        line += (f"; ranks {marked[:8]} marked steps {steps[:8]}: their marks are set aside so that every rank "
                 f"covers one window (analyse them alone, --ranks, for their steps)")
    return events, metas, line + " (call prof.step() every step for per-step numbers)"


def _with_marks(events: pd.DataFrame) -> pd.DataFrame:
    """Every row at step 0, and one mark per rank just before its first row, spanning its
    main thread's host events (any row of the rank where it has none there)."""
    rank = events["rank"].to_numpy()
    main = ((events["lane_kind"] == "host").to_numpy() & (events["lane"].astype(str) == "main").to_numpy()
            & ~events["gpu_annotation"].to_numpy(bool))
    ranks, first_row = np.unique(rank, return_index=True)
    # per rank, its main thread's rows if any, else all of its rows
    has_main = np.isin(ranks, np.unique(rank[main]))
    use = main | ~np.isin(rank, ranks[has_main])
    span = (pd.DataFrame({"rank": rank[use], "s": events["start_ns"].to_numpy(np.int64)[use],
                          "e": events["end_ns"].to_numpy(np.int64)[use], "at": np.flatnonzero(use)})
            .groupby("rank").agg(s=("s", "min"), e=("e", "max"), at=("at", "min")))
    events = _categories(events, {"name": WHOLE_MARK, "category": "step", "cat": "user_annotation",
                                  "lane_kind": "host"})
    marks = events.iloc[span["at"].to_numpy()].copy()
    for column in marks.columns.difference(_KEPT):
        marks[column] = _empty(events[column], len(marks))
    start, end = span["s"].to_numpy(np.int64), span["e"].to_numpy(np.int64)
    marks = marks.assign(name=WHOLE_MARK, category="step", cat="user_annotation", lane_kind="host",
                         start_ns=start, end_ns=end, dur_ns=end - start)
    for column in ("name", "category", "cat", "lane_kind"):
        marks[column] = marks[column].astype(events[column].dtype)
    events = events.assign(step=np.full(len(events), WHOLE_STEP, events["step"].dtype))
    # each mark just before its rank's first row: the table's order is otherwise kept
    where = np.concatenate([np.arange(len(events)) * 2 + 1, first_row * 2])
    joined = pd.concat([events, marks], ignore_index=True)
    return joined.iloc[np.argsort(where, kind="stable")].reset_index(drop=True)


def _categories(events: pd.DataFrame, values: dict) -> pd.DataFrame:
    """``events`` with each value among its column's categories (a categorical column)."""
    for column, value in values.items():
        col = events[column]
        if isinstance(col.dtype, pd.CategoricalDtype) and value not in col.cat.categories:
            events = events.assign(**{column: col.cat.add_categories([value])})
    return events


def _empty(like: pd.Series, n: int):
    """n empty values of ``like``'s column as a real ProfilerStep row has them: null where
    the column takes nulls, False for flags, 0 for plain numbers."""
    dtype = like.dtype
    if isinstance(dtype, pd.CategoricalDtype):
        return pd.Categorical([None] * n, dtype=dtype)
    if pd.api.types.is_bool_dtype(dtype) and not isinstance(dtype, pd.api.extensions.ExtensionDtype):
        return np.zeros(n, bool)
    if isinstance(dtype, pd.api.extensions.ExtensionDtype) or dtype == object:
        return pd.array([None] * n, dtype=dtype)
    return np.zeros(n, dtype)
