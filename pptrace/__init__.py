"""pptrace: profiling and tracing for Megatron-style distributed PyTorch training.

Instrumentation (``profile``, ``region``) needs torch; analysis (``analyze``, ``load_run``) does not, so
both are imported on first use: `pptrace analyze` and its loader processes skip torch's
~1.5 s and ~300 MB import.
"""
from .naming import RangeName, format_name, parse_name
from .topology import Layout

__version__ = "0.1.0"
__all__ = ["Analysis", "Layout", "RangeName", "analyze", "diff", "format_name", "load_run", "parse_name", "profile",
           "region", "__version__"]

_LAZY = {"profile": "instrument", "region": "ranges", "load_run": "run", "analyze": "analysis",
         "Analysis": "analysis", "diff": "diff"}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pptrace' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value
