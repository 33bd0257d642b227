"""``make-tiny-model --family``: which tiny checkpoint writer each family has (no heavy imports
here, so the command line's help stays fast)."""

from __future__ import annotations

from pathlib import Path

TINY_FAMILIES = ("qwen2_5_vl", "internvl", "qwen3_vl")
"""``config.json`` model types :func:`write_tiny_family` writes."""


def write_tiny_family(family: str, out: str | Path, *, seed: int = 0, overwrite: bool = False,
                      size: str = "tiny") -> Path:
    """Write the tiny checkpoint of ``family`` (:data:`TINY_FAMILIES`) to ``out``: Qwen2.5-VL
    by :func:`apbv.model.qwen2_5_vl.tiny.write_tiny_checkpoint` (``size`` tiny or medium),
    InternVL3 by
    :func:`apbv.model.internvl.tiny.write_tiny_internvl` and Qwen3-VL by
    :func:`apbv.model.qwen3_vl.tiny.write_tiny_qwen3_vl` (tiny only)."""
    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown family {family!r}; allowed: {', '.join(TINY_FAMILIES)}")
    if family == "qwen2_5_vl":
        from apbv.model.qwen2_5_vl.tiny import write_tiny_checkpoint

        return write_tiny_checkpoint(out, seed=seed, overwrite=overwrite, size=size)
    if size != "tiny":
        raise ValueError(f"--size {size} is for the qwen2_5_vl family; {family} has tiny only")
    if family == "qwen3_vl":
        from apbv.model.qwen3_vl.tiny import write_tiny_qwen3_vl

        return write_tiny_qwen3_vl(out, seed=seed, overwrite=overwrite)
    from apbv.model.internvl.tiny import write_tiny_internvl

    return write_tiny_internvl(out, seed=seed, overwrite=overwrite)
