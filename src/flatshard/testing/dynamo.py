"""What dynamo did during a run: graphs compiled, graph breaks, frames it gave up on, warnings it raised.

``watch_dynamo()`` resets dynamo (its caches and ``torch._dynamo.utils.counters``), then records, for the tests
of ``torch.compile`` on sharded models (see [Note: torch.compile]):

- the number of distinct graphs compiled so far, each time :meth:`DynamoWatch.step` is called (after a training
  step): once training runs it must stop growing;
- every graph break (``counters["graph_break"]``) and every frame dynamo gave up on (``counters["unimplemented"]``:
  a break inside a loop, a call to a disabled function), by their first line;
- the warnings raised while it runs by dynamo, AOTAutograd, inductor or FX, through ``warnings`` or logging.

:meth:`DynamoWatch.summary` is a plain dict, so a spawned rank can return it.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["DynamoWatch", "watch_dynamo"]

_LOGGERS = ("torch._dynamo", "torch._inductor", "torch._functorch", "torch.fx")
_SOURCES = ("torch/_dynamo", "torch/_inductor", "torch/_functorch", "torch/fx")
_WORDS = ("dynamo", "graph break", "recompil")


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name}: {record.getMessage()}")


class DynamoWatch:
    """Counters read while :func:`watch_dynamo` runs."""

    def __init__(self) -> None:
        self.graphs: list[int] = []  # distinct graphs compiled so far, at each step()
        self._log = _Collect()
        self._warnings: list[warnings.WarningMessage] = []

    def step(self) -> None:
        """Note the number of distinct graphs compiled so far (call it after each training step)."""
        from torch._dynamo.utils import counters

        self.graphs.append(int(counters["stats"]["unique_graphs"]))

    def breaks(self) -> dict[str, int]:
        """Every graph break and every frame dynamo gave up on so far, by the first line of its reason."""
        from torch._dynamo.utils import counters

        out: dict[str, int] = {}
        for kind in ("graph_break", "unimplemented"):
            for reason, count in counters[kind].items():
                key = f"{kind}: {str(reason).splitlines()[0]}"
                out[key] = out.get(key, 0) + int(count)
        return out

    def warnings(self) -> list[str]:
        """Warnings from dynamo and the compiler stack so far (``warnings`` and logging)."""
        raised = [
            f"{w.category.__name__}: {w.message}"
            for w in self._warnings
            if any(s in w.filename.replace("\\", "/") for s in _SOURCES)
            or any(word in str(w.message).lower() for word in _WORDS)
        ]
        return raised + list(self._log.messages)

    def summary(self) -> dict[str, Any]:
        from torch._dynamo.utils import counters

        return {
            "graphs": list(self.graphs),
            "calls_captured": int(counters["stats"]["calls_captured"]),
            "breaks": self.breaks(),
            "warnings": self.warnings(),
        }


@contextmanager
def watch_dynamo() -> Iterator[DynamoWatch]:
    """Reset dynamo, then record what it does inside (see the module docstring)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    watch = DynamoWatch()
    loggers = [logging.getLogger(name) for name in _LOGGERS]
    for logger in loggers:
        logger.addHandler(watch._log)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            watch._warnings = caught
            yield watch
    finally:
        for logger in loggers:
            logger.removeHandler(watch._log)
