"""The names other libraries write, parsed once per distinct name (not per event): which
of them are passes, p2p posts and waits, autograd and optimizer ranges, and what stage,
action and microbatch they name."""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from ...ingest.p2p_args import pp_comm_label
from .passes import SUB_ACTION

_PASS = re.compile(r"^PP:(\d+)([FBIW])(\d+)$")
_PP_P2P = re.compile(r"^PP:(\d+)(SEND|RECV)_([FB])(\d+)$")
_OVERLAP = re.compile(r"^PP:\(((?:\d+[FBIW]\d+;?)+)\)OVERLAP_F_B$")
_GPIPE = re.compile(r"^(Forward|Backward) (\d+)$")
_POSTS = {"c10d::send": True, "c10d::recv_": False}
_WIRES = {"gloo:send": True, "gloo:recv": False}
_AUTOGRAD = "autograd::engine::evaluate_function"
#: torch.optim's profiler ranges around every optimizer's step and zero_grad
#: (``Optimizer.zero_grad#SGD.zero_grad``): their ops are no pass's, even where no p2p post
#: parts them from the first stage's first forward
_OPTIMIZER = "Optimizer."


def name_table(names: pd.Index) -> pd.DataFrame:
    """One row per distinct event name: what it says (kind: pass, overlap, gpipe, pp_p2p,
    post, wire, autograd, optimizer or "" for nothing), stage, action letter, mb, is_send,
    and for torch's ``PP::<desc> (stage i)`` p2p labels (wires too) the direction of their
    sends and of their recvs (``send_dir`` / ``recv_dir``; a label of a batch of both kinds
    has both, and its side is its post's: :func:`.p2p.label_sides`)."""
    rows = []
    for name in names:
        kind, stage, act, mb, send, dirs = "", -1, "", -1, False, ("", "")
        if not isinstance(name, str):
            rows.append((kind, stage, act, mb, send, *dirs))
            continue
        if name in _POSTS:
            kind, send = "post", _POSTS[name]
        elif name in _WIRES:
            kind, send = "wire", _WIRES[name]
        elif (label := pp_comm_label(name)) is not None:
            kind, stage, dirs, send = "wire", label[2], label[:2], label[0] != ""
        elif name.startswith(_AUTOGRAD):
            kind = "autograd"
        elif name.startswith(_OPTIMIZER):
            kind = "optimizer"
        elif name.startswith("PP:"):
            if m := _PASS.match(name):
                kind, stage, act, mb = "pass", int(m.group(1)), m.group(2), int(m.group(3))
            elif m := _PP_P2P.match(name):
                kind, stage, act, mb = "pp_p2p", int(m.group(1)), m.group(3), int(m.group(4))
                send = m.group(2) == "SEND"
            elif _OVERLAP.match(name):
                kind = "overlap"
            else:
                kind = "pp_other"  # UNSHARD, RESHARD, REDUCE_GRAD: no pass
        elif m := _GPIPE.match(name):
            kind, act, mb = "gpipe", m.group(1)[0], int(m.group(2))
        rows.append((kind, stage, act, mb, send, *dirs))
    return pd.DataFrame(rows, columns=["kind", "stage", "act", "mb", "send", "send_dir", "recv_dir"])


def staged(rows: pd.DataFrame) -> np.ndarray:
    """The rows whose name gives the stage that runs them: torch's PP: actions and p2p
    ranges, and its PP:: p2p labels (the posting stage's)."""
    kind = rows["kind"].to_numpy(object)
    return np.isin(kind, ["pass", "pp_p2p"]) | ((kind == "wire") & (rows["stage"].to_numpy(np.int64) >= 0))


def _overlap_parts(name: str) -> list[tuple[int, str, int]]:
    """``PP:(7F5;0B1)OVERLAP_F_B`` -> [(7, "F", 5), (0, "B", 1)]."""
    return [(int(s), a, int(m)) for s, a, m in SUB_ACTION.findall(name.split(")")[0])]
