"""The ``flatshard`` command.

``flatshard inspect CKPT`` summarises a full (consolidated) checkpoint: training progress, every
parameter's shape and dtype, the optimizer states, and whether the file is readable at all.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["main"]


def _human(n: float) -> str:
    for unit in ("", "K", "M", "B"):
        if abs(n) < 1000:
            return f"{n:.1f}{unit}" if unit else f"{int(n)}"
        n /= 1000
    return f"{n:.1f}T"


def _inspect(path: str, show_all: bool) -> int:
    from flatshard.checkpoint.files import CheckpointError, load_checkpoint_file

    try:
        ckpt = load_checkpoint_file(path)
    except (CheckpointError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    state = ckpt.get("state_dict")
    print(f"checkpoint: {path}")
    for key in ("epoch", "global_step", "pytorch-lightning_version"):
        if key in ckpt:
            print(f"  {key}: {ckpt[key]}")
    if not isinstance(state, dict):
        print("  no 'state_dict' entry: not a Lightning checkpoint", file=sys.stderr)
        return 1
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    unique = {v.untyped_storage().data_ptr(): v for v in tensors.values()}
    numel = sum(v.numel() for v in unique.values())
    dtypes = Counter(str(v.dtype).replace("torch.", "") for v in tensors.values())
    print(f"  state_dict: {len(tensors)} tensors, {_human(numel)} elements ({dict(dtypes)})")
    rows = list(tensors.items()) if show_all else list(tensors.items())[:20]
    for key, value in rows:
        print(f"    {key:<60} {tuple(value.shape)!s:<20} {str(value.dtype).replace('torch.', '')}")
    if len(rows) < len(tensors):
        print(f"    ... {len(tensors) - len(rows)} more (use --all)")
    for i, opt in enumerate(ckpt.get("optimizer_states", [])):
        groups: list[dict[str, Any]] = opt.get("param_groups", [])
        keys = sorted({k for s in opt.get("state", {}).values() for k in s})
        print(
            f"  optimizer #{i}: {len(groups)} param groups, "
            f"{sum(len(g['params']) for g in groups)} params, state keys {keys}"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flatshard", description="flatshard checkpoint tools")
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="summarise a full (consolidated) checkpoint file")
    inspect.add_argument("checkpoint", help="path to a .ckpt file written by Trainer.save_checkpoint")
    inspect.add_argument("--all", action="store_true", help="list every tensor, not only the first 20")
    args = parser.parse_args(argv)
    if args.command == "inspect":
        return _inspect(args.checkpoint, args.all)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
