"""Schedule tables, the replay engine and what-if predictions."""
