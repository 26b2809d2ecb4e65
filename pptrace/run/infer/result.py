"""What an inference found: the events with the inferred rows, the layout, schedule and
microbatches, and how each was found.

A module of its own because every step of the inference fills it and the evidence
(evidence.py) builds one too: in ``__init__`` it would make those modules import the package
that imports them."""
from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from ...topology import Layout


@dataclass
class Inference:
    events: pd.DataFrame
    layout: Layout | None = None       # None: nothing found, keep the loader's
    schedule: str | None = None
    microbatches: int | None = None
    vpp: int | None = None
    #: what was inferred -> how, one line each (Run.inferred)
    inferred: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)
    #: rank -> the ranks of its pipeline by position, where the pipeline says (fill_peers)
    groups: dict = field(default_factory=dict)
