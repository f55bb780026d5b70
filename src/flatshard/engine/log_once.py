"""One log line per distinct message key in a process: for facts that hold for the whole run (a layout that runs
as another strategy, a fallback taken), which a loop over units, roots or saves would otherwise repeat."""

from __future__ import annotations

import logging
from collections.abc import Hashable

__all__ = ["log_once"]

# Keys already logged. Module-level on purpose: "once" means once per process, across roots, process groups and
# saves, so no object narrower than the process can own it; it holds small keys only (never tensors or groups).
_LOGGED: set[tuple[str, Hashable]] = set()


def log_once(
    logger: logging.Logger, key: Hashable, msg: str, *args: object, level: int = logging.INFO
) -> bool:
    """Log ``msg % args`` on ``logger`` at ``level`` the first time ``key`` is seen for that logger in this
    process; later calls with the same key log nothing. Returns whether it logged."""
    entry = (logger.name, key)
    if entry in _LOGGED:
        return False
    _LOGGED.add(entry)
    logger.log(level, msg, *args)
    return True
