"""Optional dependencies (pyproject's extras), imported when a feature first needs them.

A missing one is a :class:`MissingExtra`: one line naming the package and the extra that
installs it, which the command line prints as ``error: ...`` instead of a traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType


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
