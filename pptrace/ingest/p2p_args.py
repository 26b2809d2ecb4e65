"""p2p ops of plain traces: what torch writes on them with record_shapes=True (the peer and
tag of a c10d post, the bytes of gloo's range), read while a rank's table is built (frame.py),
and the labels newer torch gives pipeline p2p (:func:`pp_comm_label`)."""
from __future__ import annotations

import math
import re
from itertools import compress

import msgspec
import orjson
import pandas as pd

#: The host ops of a c10d p2p op: the post (``c10d::send`` / ``c10d::recv_``, whose
#: "Concrete Inputs" are ["", "", "<peer group rank>", "<tag>"]) and gloo's range from the
#: post until wait() returns ("Input Dims" / "Input type" give the message size).
P2P_OP_NAMES = frozenset({"c10d::send", "c10d::recv_", "gloo:send", "gloo:recv"})
#: torch.distributed.pipelining's labels of its p2p (pytorch#178907, "[PP] annotate pipeline
#: parallel P2P ops with dist.record_comm"): ``dist.record_comm(...)`` around ``_batch_p2p``
#: makes the Work's profiling title ``PP::<desc> (stage <i>)``, where gloo writes
#: ``gloo:send`` / ``gloo:recv`` (the main thread's range from the post until wait() returns)
#: and NCCL ``nccl:send`` (around the kernel's launch). ``desc`` is the schedule's name for the
#: batch (torch 2.13 schedules.py, ``_batch_p2p(..., desc=...)``): fwd_send, fwd_recv,
#: bwd_send, bwd_recv, and for a batch of both kinds fwd_send_bwd_recv / bwd_send_fwd_recv;
#: the stage is the one posting (a send's sender, a recv's receiver). torch 2.13 has
#: record_comm but its schedules do not call it yet.
PP_COMM_PREFIX = "PP::"
_PP_COMM = re.compile(r"^PP::((?:fwd|bwd)_(?:send|recv)(?:_(?:fwd|bwd)_(?:send|recv))*)(?: \(stage (\d+)\))?$")
_PP_PART = re.compile(r"(fwd|bwd)_(send|recv)")
#: torch.profiler's "Input type" names -> bytes per element
DTYPE_BYTES = {
    "float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
    "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1, "c10::complex<float>": 8,
    "c10::complex<double>": 16, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1,
}


def pp_comm_label(name) -> tuple[str, str, int] | None:
    """``PP::fwd_send_bwd_recv (stage 1)`` -> (the direction of its sends, of its recvs:
    "fwd" / "bwd" / "" where it has none or both, its stage or -1); None for any other name."""
    if not isinstance(name, str) or not name.startswith(PP_COMM_PREFIX):
        return None
    m = _PP_COMM.match(name)
    if m is None:
        return None
    parts = _PP_PART.findall(m.group(1))
    sides = {side: {d for d, s in parts if s == side} for side in ("send", "recv")}
    send, recv = (next(iter(sides[k])) if len(sides[k]) == 1 else "" for k in ("send", "recv"))
    return send, recv, int(m.group(2)) if m.group(2) else -1


def p2p_positions(names: list) -> list:
    """Positions of P2P_OP_NAMES and torch's PP:: p2p labels in a slice's names (set lookups
    in C: this runs per event; the labels are found among the distinct names)."""
    try:
        wanted = P2P_OP_NAMES.union(n for n in set(names) if pp_comm_label(n) is not None)
        return list(compress(range(len(names)), map(wanted.__contains__, names)))
    except TypeError:  # an unhashable name (a list): test value by value
        return [i for i, n in enumerate(names)
                if type(n) is str and (n in P2P_OP_NAMES or pp_comm_label(n) is not None)]


def raw_value(raw):
    if not raw:
        return None
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None


def _small_int(text):
    if type(text) is int:
        return text
    if type(text) is str and text.strip().lstrip("-").isdigit():
        return int(text)
    return None


def p2p_args(name: str, concrete, dims, types) -> dict | None:
    """What a p2p op's args say: {"group_peer", "tag"} of a c10d post, {"bytes"} of a gloo
    range; None when the args are absent (record_shapes=False) or odd."""
    if name.startswith("c10d::"):
        if not isinstance(concrete, list) or len(concrete) < 4:
            return None
        peer, tag = _small_int(concrete[2]), _small_int(concrete[3])
        return None if peer is None else {"group_peer": peer, "tag": 0 if tag is None else tag}
    if not (isinstance(dims, list) and isinstance(types, list)) or not dims or len(dims) != len(types):
        return None
    total = 0
    for shape, dtype in zip(dims, types):
        size = DTYPE_BYTES.get(dtype) if isinstance(dtype, str) else None
        if size is None or not isinstance(shape, list) or not all(type(d) is int for d in shape):
            return None
        total += size * math.prod(shape)
    return {"bytes": total}


def add_p2p_args(df: pd.DataFrame, p2p: dict) -> None:
    """c10d posts get tags {"group_peer": g, "tag": t} (the peer is a rank of the op's process
    group, which the trace does not name: pptrace.run.infer maps it to a global rank); gloo
    ranges get ``bytes``."""
    found = {row: args for row, args in p2p.items() if args}
    if not found:
        return
    sized = {row: a["bytes"] for row, a in found.items() if "bytes" in a}
    if sized:
        col = df["bytes"].copy()
        col.iloc[list(sized)] = list(sized.values())
        df["bytes"] = col
    peers = {row: orjson.dumps(a, option=orjson.OPT_SORT_KEYS).decode() for row, a in found.items() if "group_peer" in a}
    if peers:
        tags = df["tags"].cat.add_categories(sorted(set(peers.values()) - set(df["tags"].cat.categories)))
        values = pd.Series(list(peers.values()), dtype=tags.dtype)
        codes = tags.cat.codes.to_numpy().copy()
        codes[list(peers)] = values.cat.codes.to_numpy()
        df["tags"] = pd.Categorical.from_codes(codes, dtype=tags.dtype)
