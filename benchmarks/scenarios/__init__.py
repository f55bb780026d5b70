"""The scenarios, one module each, and what they share: the GPT options and the interleaved contender loop.

A scenario module has a docstring (its first line is its help), ``PRESETS`` (the first is the default),
``CONTENDERS`` and ``DEFAULT_CONTENDERS``, ``COLUMNS`` and ``PANELS`` (its table and plot), ``RATIOS`` (the
metrics compared), ``add_arguments(parser)``, ``configure(args) -> (config, variant)`` and
``run(config, contenders) -> (rows, notes)``; optionally ``ratio_pairs(rows)`` (default: ``flatshard`` over
every other row) and ``REFERENCE``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

from ..model import MODEL_FIELDS, PRESETS
from ..schema import Row

SCENARIOS = (
    "train",
    "memory",
    "checkpoint",
    "async_save",
    "generate",
    "pretrained",
    "estimate",
    "host_step",
    "tensor_parallel",
)


def add_gpt_arguments(p: argparse.ArgumentParser, steps: int, warmup: int) -> None:
    """The options of every scenario that runs the GPT of ``benchmarks/model.py`` on CPU ranks."""
    for name in MODEL_FIELDS:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help="overrides the preset")
    p.add_argument("--steps", type=int, default=steps, help=f"timed training steps (default {steps})")
    p.add_argument("--warmup", type=int, default=warmup, help=f"untimed steps first (default {warmup})")
    p.add_argument("--world-size", type=int, default=None, help="ranks (default 2; on CUDA every GPU)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (default 1)")
    p.add_argument("--seed", type=int, default=0)


def gpt_config(args: argparse.Namespace) -> dict[str, Any]:
    """The preset with the command line's overrides, and the options of :func:`add_gpt_arguments`."""
    cfg = dict(PRESETS[args.preset])
    overrides = {f: getattr(args, f) for f in MODEL_FIELDS if getattr(args, f) is not None}
    cfg.update(overrides, overrides=overrides, steps=args.steps, warmup=args.warmup, threads=args.threads)
    cfg.update(seed=args.seed, world_size=args.world_size or 2, preset=args.preset)
    if cfg["steps"] < 1 or cfg["warmup"] < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    return cfg


def interleaved(
    contenders: list[str], repeats: int, once: Callable[[str], Any]
) -> tuple[dict[str, list[Any]], dict[str, str]]:
    """``once(contender)`` for every contender, ``repeats`` times, interleaved so that a slow phase of the machine
    hits them all; per contender its results, or its error (a failing contender does not stop the others)."""
    runs: dict[str, list[Any]] = {c: [] for c in contenders}
    errors: dict[str, str] = {}
    for rep in range(repeats):
        for name in contenders:
            if name in errors:
                continue
            t0 = time.perf_counter()
            print(f"[{rep + 1}/{repeats}] {name} ...", flush=True)
            try:
                runs[name].append(once(name))
            except Exception as err:  # recorded in its row; the others still run
                errors[name] = f"{type(err).__name__}: {err}"
                print(f"    FAILED after {time.perf_counter() - t0:.0f}s: {errors[name][-600:]}", flush=True)
                continue
            print(
                f"    done in {time.perf_counter() - t0:.0f}s, load average {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    return runs, errors


def failed(name: str, error: str, label: str = "") -> Row:
    return Row(name=f"{name} {label}".strip(), contender=name, label=label, status="failed", error=error)


def check_against(rows: list[Row], reference: Row | None, close: Callable[[Row, Row], str | None]) -> None:
    """Set every ok row's ``check`` by ``close(row, reference)`` (``None``: agrees, else why not); a row that
    disagrees becomes ``"check failed"``, so nothing is compared against it."""
    for r in rows:
        if not r.ok or reference is None:
            continue
        why = None if r is reference else close(r, reference)
        r.check = {"ok": why is None, "against": reference.name, **({"why": why} if why else {})}
        if why:
            r.status = "check failed"
