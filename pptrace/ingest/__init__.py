"""Trace files -> one aligned, matched Run: read, normalise, cache, align clocks, pair p2p, infer."""
