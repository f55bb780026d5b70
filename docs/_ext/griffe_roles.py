"""Griffe extension for the documentation build: Sphinx cross-reference roles in docstrings as code.

The docstrings in ``src/flatshard`` are reStructuredText-flavoured Google style; Markdown has no
``:class:`X``` role, so ``:class:`X``` (also ``:func:``, ``:meth:``, ``:attr:``, ``:mod:``, ``:exc:``,
``:data:``, ``:obj:``) is rendered as the inline code ``X`` (``~a.b.X`` as ``X``).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|exc|data|obj):`~?([^`]+)`")


def _replace(match: re.Match[str]) -> str:
    target = match.group(1)
    if match.group(0).split("`", 1)[1].startswith("~"):
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


class SphinxRolesAsCode(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_replace, obj.docstring.value)
