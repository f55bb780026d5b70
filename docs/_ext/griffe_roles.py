"""Griffe extension for the documentation build: Sphinx cross-reference roles in docstrings as code.

The docstrings in ``src/flatshard`` are reStructuredText-flavoured Google style; Markdown has no
``:class:`X``` role, so ``:class:`X``` (also ``:func:``, ``:meth:``, ``:attr:``, ``:mod:``, ``:exc:``,
``:data:``, ``:obj:``) is rendered as the inline code ``X`` (``~a.b.X`` as ``X``).

A class whose docstring is completed at import (``__doc_generated__``: the strategies, whose ``Args:`` come
from the options' descriptions) is documented with the text Python sees, which a static reading misses.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|exc|data|obj):`~?([^`]+)`")


def _replace(match: re.Match[str]) -> str:
    target = match.group(1)
    if match.group(0).split("`", 1)[1].startswith("~"):
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def _generated(obj: griffe.Object) -> str | None:
    if not obj.is_class:
        return None
    try:
        runtime = getattr(importlib.import_module(obj.module.path), obj.name)
    except (ImportError, AttributeError):
        return None
    if getattr(runtime, "__doc_generated__", False) and runtime.__doc__:
        return inspect.cleandoc(runtime.__doc__)
    return None


class SphinxRolesAsCode(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        generated = _generated(obj)
        if generated is not None and obj.docstring is not None:
            obj.docstring.value = generated
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_replace, obj.docstring.value)
