"""flatshard's environment switches, read and validated in one place.

[Note: environment switches]
A few ``FLATSHARD_*`` variables turn an optimisation of the CPU path off, to compare with it or to get around
a system where it misbehaves. Each is validated wherever it is read, as an argument would be: a value outside
the accepted ones raises ``ValueError`` naming the variable, its value, what it accepts and a ``HINT:``, never
a bare conversion error, and never a silent default. ``shard()`` reads them all once
(:func:`check_environment`), so a typo fails at setup on every rank, not in the middle of a step. Every
variable is read here and nowhere else; one that overrides an argument (``FLATSHARD_DESYNC_TIMEOUT``, the
``desync_timeout`` option) accepts exactly what the argument accepts. The guide's "Environment variables"
table lists them all.
"""

from __future__ import annotations

import math
import os

import torch.distributed as dist

__all__ = ["FLAGS", "INTEGERS", "SECONDS", "check_environment", "env_flag", "env_int", "env_seconds"]

# name -> (default, what it switches); "0" turns it off, "1" on
FLAGS: dict[str, tuple[bool, str]] = {
    "FLATSHARD_SHM": (
        True,
        "collectives and full-state gathers of CPU ranks on one host through shared memory",
    ),
    "FLATSHARD_SHM_DIRECT": (True, "shared-memory all-gathers reading the peers' memory in place"),
    "FLATSHARD_CPU_HUGEPAGES": (True, "huge pages requested for large CPU buffers"),
    "FLATSHARD_CPU_REUSE": (
        True,
        "gathered-parameter blocks reused within a forward or backward pass on CPU",
    ),
    "FLATSHARD_PREFAULT": (True, "helper threads that back the pages of a full state's outputs"),
}
# name -> (default, minimum, what it sets)
INTEGERS: dict[str, tuple[int, int, str]] = {
    "FLATSHARD_PREFAULT_THREADS": (2, 1, "the number of page-backing helper threads"),
}


# name -> (the argument it overrides, what it sets): a positive number of seconds, or 0 / none / off
SECONDS: dict[str, tuple[str, str]] = {
    "FLATSHARD_DESYNC_TIMEOUT": ("desync_timeout", "the desync detector's no-progress limit"),
}


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


def env_int(name: str) -> int:
    """The integer ``name`` of :data:`INTEGERS`: its default when unset, else a whole number at least its minimum."""
    default, minimum, what = INTEGERS[name]
    value = os.environ.get(name)
    if value is None:
        return default
    number = int(value) if value.isascii() and value.isdigit() else None
    if number is None or number < minimum:
        raise ValueError(
            f"{_rank()}environment variable {name}={value!r} is not a whole number >= {minimum} ({what}). "
            f"HINT: set a plain number such as {name}={default} (no sign, unit or spaces), or unset it for "
            f"the default ({default})."
        )
    return number


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
    """Read every switch above: raises the first malformed one's error (see [Note: environment switches])."""
    for name in FLAGS:
        env_flag(name)
    for name in INTEGERS:
        env_int(name)
    for name in SECONDS:
        env_seconds(name, None)
