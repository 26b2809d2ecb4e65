"""What an analysis could not tell, in one line each: the warnings of the contract-4 document
beyond the loader's (missing ranks and steps, unpaired p2p, shaky clocks, plain traces, GPU
runs that look launch-bound, ep split sizes that do not add up). Each is a function of the
analysis' tables, so that the facade (analysis.py) only gathers them."""
from __future__ import annotations

import numpy as np
import pandas as pd

from .analyzers.ep_pairs import EpPairs
from .analyzers.gpu_timeline import is_launch_bound
from .analyzers.p2p import peer_not_loaded
from .analyzers.partition import untagged_p2p_rows
from .run.model import Run
from .sweeps import isin
from .timeline.projection import KERNEL_CATEGORIES
from .vocab import RANGE_KINDS

#: an alignment bound above this share of the mean step time makes cross-rank numbers shaky.
CLOCK_WARN_FRACTION = 0.01


def gpu_warnings(run: Run, acts: dict, gpu: pd.DataFrame, contract: bool) -> list[str]:
    """What a GPU trace could not tell, and the launch-bound hint."""
    warnings = []
    if not contract and len(gpu):
        warnings.append(
            "traces without pptrace ranges: pipeline bubble cannot be separated from p2p wait; NCCL send/recv "
            "kernels count as pp_transfer (wait included) and GPU idle time as other; showing "
            "idle instead (instrument the trainer with pptrace.region for the full breakdown)"
        )
    guessed = {r: a.unknown_groups for r, a in acts.items() if a.unknown_groups}
    if guessed:
        warnings.append(
            f"{sum(guessed.values())} NCCL collective kernels (ranks {sorted(guessed)[:8]}) belong to "
            "process groups that neither a pg_desc nor the layout names: counted as dp (all_to_all "
            "as ep); give the layout (tp/cp/pp/dp) or name groups with new_group(group_desc=...)"
        )
    if len(gpu):
        mean = gpu.groupby("rank")[["time_s", "idle_s", "launch_bound_s", "host_launching_s"]].mean()
        flagged = mean[is_launch_bound(mean["idle_s"], mean["time_s"], mean["launch_bound_s"])]
        warnings += [
            f"rank {rank} looks launch-bound: the GPU is idle {idle / time:.0%} of "
            f"the step, {bound / idle:.0%} of it waiting for the host to "
            f"launch work (host in CUDA calls {launching * 1e3:.2f} ms of it); "
            "fewer, larger kernels (fusion, CUDA graphs) or less host work per step would help"
            for rank, time, idle, bound, launching in zip(
                flagged.index, flagged["time_s"], flagged["idle_s"], flagged["launch_bound_s"],
                flagged["host_launching_s"])
        ]
    return warnings


def has_contract_ranges(events: pd.DataFrame) -> bool:
    """Whether any host range has a contract-1 kind (vocab.RANGE_KINDS)."""
    return bool((isin(events["kind"], RANGE_KINDS) & (events["lane_kind"] == "host").to_numpy()).any())


def peer_loaded(unmatched: pd.DataFrame, requested) -> pd.DataFrame:
    """The unmatched p2p ranges but those whose peer --ranks left out (said once by load_run,
    "peer not loaded"; their split is unknown, not transfer)."""
    return unmatched[~peer_not_loaded(unmatched, requested)]


def input_warnings(run: Run, partitions, pairs_unmatched) -> list[str]:
    ev = run.events
    warnings = []
    gpu_run = isin(ev["category"], KERNEL_CATEGORIES).any()
    if not has_contract_ranges(ev) and not gpu_run:
        warnings.append(
            "traces without pptrace ranges: dims from process-group metadata; bubble cannot be "
            "separated from p2p: NCCL send/recv kernels count as pp_transfer, and time outside "
            "kernels as other (instrument the trainer with pptrace.region for the full breakdown)"
        )
    missing = list(getattr(run, "missing_ranks", ()))  # of the ranks requested (load_run's ranks)
    if missing and not any("no usable trace" in w for w in run.warnings):
        warnings.append(f"ranks {missing[:8]} of {run.layout.world_size} have no trace; results cover the others only")
    stepped = set(partitions.rank.tolist())
    unstepped = sorted(set(run.ranks) - stepped)
    if unstepped:
        warnings.append(
            f"ranks {unstepped[:8]} have no profiled ProfilerStep#N range on their main thread; "
            "their time is not partitioned (call prof.step() every step)"
        )
    untagged = int(untagged_p2p_rows(ev).sum())
    if untagged:
        warnings.append(
            f"{untagged} pipeline p2p ranges carry no peer/mb tags (Megatron's own range names): "
            "they cannot be paired, so their wait and transfer are not split; counted as pp_transfer"
        )
    if len(pairs_unmatched):
        warnings.append(
            f"{len(pairs_unmatched)} pipeline p2p ranges have no matching peer range; their time "
            "counts as pp_transfer (wait and transfer cannot be told apart without the peer)"
        )
    already = any("clock alignment" in w for w in run.warnings)
    if len(partitions) and run.uncertainty_ns and not already:
        step = float(np.mean(partitions.wall_ns))
        bad = {r: b for r, b in run.uncertainty_ns.items() if b and b > CLOCK_WARN_FRACTION * step}
        if bad:
            worst = max(bad, key=bad.get)
            warnings.append(
                f"clock alignment of ranks {sorted(bad)[:8]} is uncertain by up to "
                f"{bad[worst] / 1e6:.2f} ms (rank {worst}), over {CLOCK_WARN_FRACTION:.0%} of the "
                "step: cross-rank bubble/wait splits are approximate"
            )
    return warnings


def ep_warnings(pairs: EpPairs) -> list[str]:
    if not pairs.inconsistent:
        return []
    return [f"ep all-to-all split sizes of ranks {list(pairs.inconsistent)[:8]} do not add up (a rank's "
            "sends against the rows it moved, or against what each peer says it got): the ep pair sizes "
            "of those ranks are unmeasured"]
