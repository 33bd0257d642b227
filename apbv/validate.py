"""The value checks every layer shares: each raises ValueError naming the setting, the allowed
values or range and the value it got, before any work is spent on it.

Pure (no torch, no apbv import), so the config, the planner, the video and capture sides and
the command line all use the same messages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, overload


def one_of(name: str, value: Any, allowed: Sequence[Any]) -> None:
    """ValueError unless ``value`` is in ``allowed``: "NAME must be one of a, b; got VALUE"."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}; got {value!r}")


def boolean(name: str, value: Any) -> None:
    """ValueError unless ``value`` is a bool: "NAME must be true or false, got VALUE (TYPE)"."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r} ({type(value).__name__})")


def string(name: str, value: Any) -> None:
    """ValueError unless ``value`` is a str: "NAME must be a string, got VALUE (TYPE)"."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {value!r} ({type(value).__name__})")


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` if it is an int (not a bool) >= ``minimum``, else ValueError naming ``name``
    ("NAME must be an integer, got ..." or "NAME must be >= MINIMUM, got ...")."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def integer(name: str, value: Any, low: int, high: int | None = None,
            *, optional: bool = False) -> Any:
    """``value`` if it is an int (not a bool, not a float such as 8.0) in ``low .. high``
    (None: no upper bound; None itself allowed with ``optional``), else ValueError:
    "NAME must be an integer in LOW .. HIGH" (or ">= LOW"), with the value and, for a value
    of the wrong type, its type."""
    if value is None and optional:
        return None
    allowed = f"in {low} .. {high}" if high is not None else f">= {low}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r} "
                         f"({type(value).__name__})")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be an integer {allowed}, got {value}")
    return value


def number(name: str, value: Any, *, low: float = 0.0, low_open: bool = True,
           high: float | None = None, optional: bool = False) -> Any:
    """``value`` if it is a finite int or float (not a bool, not nan/inf) > ``low`` (>= with
    ``low_open=False``) and <= ``high`` (None allowed with ``optional``), else ValueError:
    "NAME must be a number (> LOW ...)", "... a finite number (...)" or "NAME must be > LOW"."""
    if value is None and optional:
        return None
    allowed = f"{'>' if low_open else '>='} {low:g}"
    if high is not None:
        allowed += f" and <= {high:g}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number ({allowed}), got {value!r} "
                         f"({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number ({allowed}), got {value!r}")
    if value < low or (low_open and value == low) or (high is not None and value > high):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return value


@overload
def positive(name: str, value: object, *, allow_none: Literal[False] = False,
             allow_zero: bool = False, unit: str | None = None) -> float: ...


@overload
def positive(name: str, value: object, *, allow_none: bool, allow_zero: bool = False,
             unit: str | None = None) -> float | None: ...


def positive(name: str, value: object, *, allow_none: bool = False, allow_zero: bool = False,
             unit: str | None = None) -> float | None:
    """``value`` as a float: a finite number > 0 (>= 0 with ``allow_zero``; None with
    ``allow_none``), else ValueError: "NAME must be a finite number [of UNIT] > 0 [or None],
    got VALUE" (a duration: ``unit="seconds"``)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        extra = " or None" if allow_none else ""
        of = f" of {unit}" if unit else ""
        raise ValueError(f"{name} must be a finite number{of} {bound}{extra}, got {value!r}")
    return float(value)


MAX_STATIC_THRESHOLD = 255.0
"""The largest temporal-pruning threshold (channel levels 0-255); a higher one is refused."""


def pruning_settings(pruning_rate: Any, static_threshold: Any, *,
                     names: tuple[str, str] = ("video.pruning_rate", "video.static_threshold"),
                     ) -> None:
    """ValueError naming the setting (``names``: the rate's and the threshold's) unless
    ``pruning_rate`` is in [0, 1) (the fraction of video tokens removed; 0: off) and
    ``static_threshold`` is a number in [0, :data:`MAX_STATIC_THRESHOLD`] levels (0: off)."""
    rate_name, threshold_name = names
    for name, value in ((rate_name, pruning_rate), (threshold_name, static_threshold)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if not 0 <= pruning_rate < 1:
        raise ValueError(f"{rate_name} must be in [0, 1) (the fraction of video tokens removed; "
                         f"0: off), got {pruning_rate!r}")
    if not 0 <= static_threshold <= MAX_STATIC_THRESHOLD:
        raise ValueError(f"{threshold_name} must be in [0, {MAX_STATIC_THRESHOLD:g}] levels "
                         f"(0: off), got {static_threshold!r}")
