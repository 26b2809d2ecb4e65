"""Rank tables -> one frozen Run: headers and ranks, the load, p2p pairs and collective instances
(match), clock offsets (align), a pptrace block's claims checked against the traces (claims),
and what a plain or foreign trace lets be inferred (infer/)."""
from .build import load_run
from .model import Run

__all__ = ["Run", "load_run"]
