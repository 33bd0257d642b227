"""APB-V attention: the distributed op, its kernels adapter, selection and LSE merge."""

from apbv.attention.kernels import attention
from apbv.attention.merge import merge_partials
from apbv.attention.spava import MODES, apbv_attention

__all__ = ["MODES", "apbv_attention", "attention", "merge_partials"]
