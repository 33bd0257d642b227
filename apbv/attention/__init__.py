"""APB-V attention: the distributed op, its kernels adapter, selection and LSE merge."""

from apbv.attention.kernels import attention
from apbv.attention.merge import merge_partials
from apbv.attention.spava import apbv_attention

__all__ = ["apbv_attention", "attention", "merge_partials"]
