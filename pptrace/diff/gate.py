"""The gate CI runs on a diff: ``--gate 'step>+3%'``, ``'pp_bubble>+5ms'``,
``'stage2.dp_exposed>+10%'``. A gate fails when NEW is worse than BASE beyond its threshold
(a share of BASE's value, or a time) *and* beyond noise; the CLI then exits 3. The verdict is
one line: PASS or FAIL with the numbers, or without gates what changed."""
from __future__ import annotations

import re
from dataclasses import dataclass

from .cells import BUBBLE_ITEMS, COMPUTE_ITEMS
from .words import change_text, noise_text
from ..vocab import PARTS

#: what a gate may name: the step time, a part of the partition, a waterfall item
METRICS = ("step", *PARTS, *COMPUTE_ITEMS, *BUBBLE_ITEMS)
_UNITS = {"%": None, "ms": 1e-3, "s": 1.0, "us": 1e-6, "\u00b5s": 1e-6}
_SPEC = re.compile(r"^\s*(?:stage(?P<stage>\d+)\.)?(?P<metric>[a-z_]+)\s*>\s*\+?\s*(?P<value>\d+(?:\.\d*)?|\.\d+)"
                   r"\s*(?P<unit>%|ms|s|us|\u00b5s)\s*$")
EXAMPLE = "write METRIC>+N% or METRIC>+Nms, e.g. 'step>+3%', 'pp_bubble>+5ms', 'stage2.dp_exposed>+10%'"


@dataclass(frozen=True)
class Gate:
    """``metric`` worse by more than ``threshold`` (a fraction of BASE when ``relative``, else
    seconds), for the run or for one ``stage``."""

    metric: str
    threshold: float
    relative: bool
    stage: int | None = None
    spec: str = ""

    def __post_init__(self):
        if self.metric not in METRICS:
            raise ValueError(f"gate {self.spec or self.metric!r}: unknown metric {self.metric!r}; one of "
                             f"{', '.join(METRICS)}")
        if not self.threshold >= 0:
            raise ValueError(f"gate {self.spec!r}: threshold {self.threshold!r} must be a number >= 0")
        if self.stage is not None and self.stage < 0:
            raise ValueError(f"gate {self.spec!r}: stage {self.stage} must be >= 0")


def parse_gate(text: str) -> Gate:
    """'step>+3%' -> Gate; a ValueError in one line for anything else."""
    found = _SPEC.match(str(text))
    if found is None:
        raise ValueError(f"gate {text!r} is not a gate: {EXAMPLE}")
    unit, value = found["unit"], float(found["value"])
    return Gate(metric=found["metric"], threshold=value / 100 if unit == "%" else value * _UNITS[unit],
                relative=unit == "%", stage=None if found["stage"] is None else int(found["stage"]), spec=str(text).strip())


def _column(metric: str) -> str:
    return "time_s" if metric == "step" else metric


def evaluate(gate: Gate, run: dict, stages: dict) -> dict:
    """The gate against the diff's changes (``run``: quantity -> change for the run;
    ``stages``: stage -> quantity -> change)."""
    scope = run if gate.stage is None else stages.get(gate.stage)
    where = "" if gate.stage is None else f"stage {gate.stage} "
    if scope is None:
        raise ValueError(f"gate {gate.spec!r}: stage {gate.stage} is not a stage both runs have")
    change = scope.get(_column(gate.metric))
    if change is None:
        raise ValueError(f"gate {gate.spec!r}: {gate.metric} is not split in both documents; gate on "
                         f"{'compute' if gate.metric in COMPUTE_ITEMS else 'pp_bubble'} instead")
    if gate.relative:
        worse = change["delta_s"] > gate.threshold * change["base_s"] if change["base_s"] > 0 else change["delta_s"] > 0
    else:
        worse = change["delta_s"] > gate.threshold
    failed = bool(worse and change["significant"] is not False)
    limit = f"{gate.threshold:+.0%}" if gate.relative else f"+{gate.threshold * 1e3:g} ms"
    if failed:
        line = f"{where}{gate.metric} {change_text(change)} > {limit} and {noise_text(change)}"
    elif worse:
        line = f"{where}{gate.metric} {change_text(change)} > {limit} but {noise_text(change)}"
    else:
        line = f"{where}{gate.metric} {change_text(change)} within {limit}"
    return {"spec": gate.spec, "metric": gate.metric, "stage": gate.stage, "threshold": gate.threshold,
            "relative": gate.relative, **change, "worse_than_threshold": bool(worse), "failed": failed,
            "line": line}


def verdict(step: dict, results: list[dict]) -> dict:
    """{status, line, gates}: ``fail`` / ``pass`` with gates; without, ``slower``, ``faster``
    or ``unchanged`` by the step time against noise."""
    if results:
        failed = [r for r in results if r["failed"]]
        shown = failed or results
        status = "fail" if failed else "pass"
        line = f"{status.upper()}: " + "; ".join(r["line"] for r in shown)
        if not failed:
            line += f" [gate{'s' if len(results) > 1 else ''} {', '.join(r['spec'] for r in results)}]"
    else:
        quiet = step["significant"] is False or step["delta_s"] == 0  # None: noise unknown, the sign says
        status = "unchanged" if quiet else "slower" if step["delta_s"] > 0 else "faster"
        line = {"unchanged": "no significant change", "slower": "slower", "faster": "faster"}[status]
        line += f": step {change_text(step)}, {noise_text(step)}"
    return {"status": status, "line": line, "gates": results}
