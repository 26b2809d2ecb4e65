"""Offline interactive dashboards: one self-contained Plotly HTML page per run."""
from .page import write_dashboard
from .timeline import Timeline, build_timeline

__all__ = ["write_dashboard", "build_timeline", "Timeline"]
