"""apbv: distributed long-video prefill with APB-V ("Spava") approximate attention."""

from apbv.attention import MODES, apbv_attention
from apbv.plan import Plan, make_plan

__version__ = "0.1.0"

__all__ = ["MODES", "Plan", "__version__", "apbv_attention", "make_plan"]
