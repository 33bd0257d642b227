"""apbv: distributed long-video prefill with APB-V ("Spava") approximate attention.

The public names are imported on first use (PEP 562), so ``import apbv`` and the command's
``--help`` and ``--version`` do not import torch.

Optional dependencies (pyproject's extras) are imported when a feature first needs them
(:func:`import_extra`). A missing one is a :class:`MissingExtra`: one line naming the package and
the extra that installs it, which the command line prints as ``error: ...`` instead of a
traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
"""The package's version; pyproject.toml's ``version`` (a test checks they agree)."""

_LAZY = {
    "apbv_attention": "apbv.attention",
    "MODES": "apbv.modes",
    "Mode": "apbv.modes",
    "get_mode": "apbv.modes",
    "Plan": "apbv.plan",
    "make_plan": "apbv.plan",
}

if TYPE_CHECKING:
    from apbv.attention import apbv_attention
    from apbv.modes import MODES, Mode, get_mode
    from apbv.plan import Plan, make_plan

__all__ = ["MODES", "MissingExtra", "Mode", "Plan", "__version__", "apbv_attention", "get_mode",
           "import_extra", "make_plan", "package_version"]


def package_version() -> str:
    """The installed distribution's version (its metadata), else :data:`__version__` (a checkout
    run without installing)."""
    from importlib import metadata

    try:
        return metadata.version("apbv")
    except metadata.PackageNotFoundError:
        return __version__


class MissingExtra(ImportError):
    """A package of one of apbv's extras is not installed; the message says how to install it."""


def import_extra(module: str, *, package: str, extra: str, purpose: str) -> ModuleType:
    """Import ``module`` (of the distribution ``package``, in the extra ``extra``) for
    ``purpose``; raises :class:`MissingExtra` naming the extra if it cannot be imported."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingExtra(
            f"{purpose} needs the package {package!r} of apbv's {extra!r} extra: "
            f"pip install 'apbv[{extra}]' (from a clone: pip install -e '.[{extra}]')"
        ) from err


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use (``apbv.apbv_attention`` imports torch)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'apbv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
