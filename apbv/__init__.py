"""apbv: distributed long-video prefill with APB-V ("Spava") approximate attention."""

from apbv.attention import apbv_attention
from apbv.modes import MODES, Mode, get_mode
from apbv.plan import Plan, make_plan

__version__ = "0.1.0"

__all__ = ["MODES", "Mode", "Plan", "__version__", "apbv_attention", "get_mode", "make_plan"]
