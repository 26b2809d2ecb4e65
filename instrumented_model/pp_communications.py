"""Pipeline point-to-point communication: ``post`` one op of any directions, ``wait`` on it.

The schedules' programs (``pptrace.schedules.tables``) name each op's directions, and
``pipeline_parallel.execute`` posts exactly those: Megatron's combined functions
(``send_forward_recv_backward``, the interleaved four-way
``send_forward_backward_recv_forward_backward``, ...) are one ``post`` of their directions.
Every op posts ``dist.isend``/``dist.irecv`` to *global* peer ranks and then waits, and each
direction is wrapped in a contract-1 region (``pp:send_fwd``, ``pp:recv_fwd``,
``pp:send_bwd``, ``pp:recv_bwd``) that spans from posting to completion. Combined ops
nest their regions, post everything, then wait for
everything, like Megatron's ``batch_isend_irecv`` path.

Tag convention (how the analysis pairs a send with its recv across ranks): both sides tag a
message with ``peer`` (the other side's global rank), ``mb`` (the microbatch the tensor
belongs to) and, when interleaved, ``chunk`` = the model chunk that *consumes* the tensor
on the receiving rank. So the send of stage p-1's chunk-0 activation to stage 0 is tagged
``chunk=1`` on both sides, and a gradient sent by stage 0's chunk 1 to stage p-1 is tagged
``chunk=0``. A send and a recv pair up when their (direction, mb, chunk) agree and each
names the other as peer.

Forward and backward traffic use different gloo/NCCL message tags: with pp=2 (or the
interleaved ring) two ranks exchange both directions, and messages of one direction must
never be matched with a recv of the other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from pptrace import region

_FORWARD_TAG = 0
_BACKWARD_TAG = 1


@dataclass(frozen=True)
class P2PContext:
    """What every p2p op of one rank needs: its neighbours and the activation shape.

    ``prev_rank``/``next_rank`` are global ranks; for the interleaved ring they wrap around
    (stage 0's prev is the last stage), otherwise they are None at the pipeline ends.
    """

    prev_rank: Optional[int]
    next_rank: Optional[int]
    shape: tuple  # (s_part, b, h)
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    group: Any = None
    tag_chunks: bool = False  # only interleaved runs tag chunk=

    def __post_init__(self):
        if len(self.shape) != 3 or any(int(d) < 1 for d in self.shape):
            raise ValueError(f"P2PContext.shape {self.shape!r} must be a positive (s, b, h)")

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= int(d)
        return numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Message:
    """One direction of a p2p op: which microbatch and consuming chunk it carries."""

    mb: int
    chunk: int = 0
    tensor: Optional[torch.Tensor] = None  # set for sends


def _region(ctx: P2PContext, op: str, peer: int, msg: Message):
    return region(
        f"pp:{op}",
        peer=peer,
        mb=msg.mb,
        chunk=msg.chunk if ctx.tag_chunks else None,
        bytes=ctx.nbytes,
    )


class PendingP2P:
    """Posted p2p ops whose regions stay open until ``wait``. Work done between posting and
    waiting (ZB-H1 runs its deferred W passes there) nests inside the regions: the ranges
    still span posting to completion, and the contract-3 sweep counts that time as compute."""

    def __init__(self, regions, requests, received):
        self._regions, self._requests, self._received = regions, requests, received

    def wait(self):
        """Wait for every op; returns (tensor_from_prev, tensor_from_next)."""
        try:
            for request in self._requests:
                request.wait()
        finally:
            for r in reversed(self._regions):
                r.__exit__(None, None, None)
            self._regions = []
        return self._received.get("recv_fwd"), self._received.get("recv_bwd")


def post(
    ctx: P2PContext,
    *,
    send_next: Optional[Message] = None,
    send_prev: Optional[Message] = None,
    recv_prev: Optional[Message] = None,
    recv_next: Optional[Message] = None,
) -> PendingP2P:
    """Open the regions and post the given sends/recvs without waiting.

    A direction whose peer does not exist (pipeline end) is skipped, as in Megatron.
    """
    # (op name, peer, message, is_send, gloo tag) for each direction actually present.
    plan = []
    if send_next is not None and ctx.next_rank is not None:
        plan.append(("send_fwd", ctx.next_rank, send_next, True, _FORWARD_TAG))
    if send_prev is not None and ctx.prev_rank is not None:
        plan.append(("send_bwd", ctx.prev_rank, send_prev, True, _BACKWARD_TAG))
    if recv_prev is not None and ctx.prev_rank is not None:
        plan.append(("recv_fwd", ctx.prev_rank, recv_prev, False, _FORWARD_TAG))
    if recv_next is not None and ctx.next_rank is not None:
        plan.append(("recv_bwd", ctx.next_rank, recv_next, False, _BACKWARD_TAG))

    regions, requests, received = [], [], {}
    pending = PendingP2P(regions, requests, received)
    try:
        for op, peer, msg, is_send, tag in plan:
            r = _region(ctx, op, peer, msg)
            r.__enter__()
            regions.append(r)
        for op, peer, msg, is_send, tag in plan:
            if is_send:
                # isend needs a contiguous buffer; detach so autograd state never travels.
                buf = msg.tensor.detach().contiguous()
                requests.append(dist.isend(buf, dst=peer, group=ctx.group, tag=tag))
            else:
                buf = torch.empty(ctx.shape, dtype=ctx.dtype, device=ctx.device)
                requests.append(dist.irecv(buf, src=peer, group=ctx.group, tag=tag))
                received[op] = buf
    except BaseException:
        for r in reversed(regions):
            r.__exit__(None, None, None)
        raise
    return pending
