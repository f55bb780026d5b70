"""flatshard's environment switches, read and validated in one place.

[Note: environment switches]
Two ``FLATSHARD_*`` variables remain, each for a reason an argument cannot serve (the guide's "Environment
variables" table gives them):

- ``FLATSHARD_SHM=0`` turns the shared-memory transport of CPU ranks off (see [Note: shared-memory
  collectives]): a way around a system where it misbehaves, for every process group and every collective (a
  step's and a full-state gather's alike), and it must be the same on every rank of a job, which the launcher's
  environment guarantees and a per-call argument would not.
- ``FLATSHARD_DESYNC_TIMEOUT`` overrides every root's ``desync_timeout`` (see [Note: finding a desync]): to stop
  the detector, or give it longer, in a job whose code sets the argument (a breakpoint on one rank, a run under
  a debugger), without editing that code.

Each is validated wherever it is read, as an argument would be: a value outside the accepted ones raises
``ValueError`` naming the variable, its value, what it accepts and a ``HINT:``, never a bare conversion error,
and never a silent default. ``shard()`` reads them all once (:func:`check_environment`), so a typo fails at
setup on every rank, not in the middle of a step. Every variable is read here and nowhere else. Switches of
earlier versions that only served benchmarks and debugging are gone; one still set is reported with a warning
(:data:`REMOVED`), never silently ignored.
"""

from __future__ import annotations

import math
import os
import warnings
from types import MappingProxyType

import torch.distributed as dist

__all__ = ["FLAGS", "REMOVED", "SECONDS", "check_environment", "env_flag", "env_seconds"]

# name -> (default, what it switches); "0" turns it off, "1" on
FLAGS = MappingProxyType(
    {
        "FLATSHARD_SHM": (
            True,
            "collectives and full-state gathers of CPU ranks on one host through shared memory",
        ),
    }
)

# name -> (the argument it overrides, what it sets): a positive number of seconds, or 0 / none / off
SECONDS = MappingProxyType(
    {"FLATSHARD_DESYNC_TIMEOUT": ("desync_timeout", "the desync detector's no-progress limit")}
)

# switches of earlier versions, no longer read -> what replaced them
REMOVED = MappingProxyType(
    {
        "FLATSHARD_SHM_DIRECT": "all-gathers read peers' memory wherever the system allows it, else use the slots",
        "FLATSHARD_CPU_HUGEPAGES": "huge pages follow /sys/kernel/mm/transparent_hugepage/enabled",
        "FLATSHARD_CPU_REUSE": "gathered blocks are always reused within a pass",
        "FLATSHARD_PREFAULT": "full-state outputs are always prefaulted where the kernel can",
        "FLATSHARD_PREFAULT_THREADS": "two helper threads prefault them",
    }
)


def _rank() -> str:
    if dist.is_available() and dist.is_initialized():
        return f"[rank {dist.get_rank()}] "
    return ""


def env_flag(name: str) -> bool:
    """The switch ``name`` of :data:`FLAGS`: its default when unset, ``False`` for ``"0"``, ``True`` for ``"1"``."""
    default, what = FLAGS[name]
    value = os.environ.get(name)
    if value is None:
        return default
    if value in ("0", "1"):
        return value == "1"
    raise ValueError(
        f"{_rank()}environment variable {name}={value!r} is not a switch: it accepts 0 (off) or 1 (on, the "
        f"default) for {what}. HINT: set {name}=0 to turn it off, or unset it."
    )


def env_seconds(name: str, argument: float | None) -> float | None:
    """The duration ``name`` of :data:`SECONDS` overriding ``argument`` (its argument's value) when set: a
    positive number of seconds, or ``0`` / ``none`` / ``off`` (``None``: off), as the argument accepts."""
    value = os.environ.get(name)
    if value is None:
        return argument
    text = value.strip().lower()
    if text in ("", "0", "none", "off"):
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        option, what = SECONDS[name]
        raise ValueError(
            f"{_rank()}environment variable {name}={value!r} is not a positive number of seconds ({what}). HINT: "
            f"set it to a number of seconds such as 60 (no unit), or to 0 / none / off to turn it off; unset it "
            f"to use the {option} argument."
        )
    return seconds


def check_environment() -> None:
    """Read every switch above: raises the first malformed one's error (see [Note: environment switches]); a
    removed switch still set gets a warning (shown once per process, as Python shows a warning)."""
    for name in FLAGS:
        env_flag(name)
    for name in SECONDS:
        env_seconds(name, None)
    for name, instead in REMOVED.items():
        if name in os.environ:
            warnings.warn(
                f"flatshard: the environment variable {name} is no longer read ({instead}). HINT: unset it.",
                stacklevel=3,
            )
