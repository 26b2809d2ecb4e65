"""pptrace: profiling and tracing for Megatron-style distributed PyTorch training."""
from .instrument import profile, region
from .naming import RangeName, format_name, parse_name
from .topology import Layout

__version__ = "0.1.0"
__all__ = ["Layout", "RangeName", "format_name", "parse_name", "profile", "region", "__version__"]
