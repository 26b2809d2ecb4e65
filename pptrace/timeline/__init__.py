"""Query primitives over an events table, used by the run builder and the analyzers: named row
selections and busy intervals (intervals), step and pipeline windows (windows), p2p exchanges
(exchanges), per-rank activity (activity), host ranges projected to where their GPU work ran
(projection)."""
