"""The ``flatshard`` command.

- ``flatshard inspect CKPT`` summarises a checkpoint (a full file or a sharded directory): training
  progress, every parameter's shape and dtype, the optimizer states, and whether it is readable at all.
- ``flatshard estimate TARGET --world-size 8,64,512`` estimates per-rank memory and step communication of a
  model built on the meta device, before any GPU is rented: see ``flatshard/estimator/``.
- ``flatshard consolidate DIR OUT.ckpt`` turns a sharded checkpoint directory into one full checkpoint
  file (a plain Lightning checkpoint), on one process, without a GPU or a process group.
  ``flatshard consolidate SRC OUT.safetensors`` writes the model weights only (SRC a directory or a full
  file; ``--prefix``, ``--ema``), for inference tools: see ``flatshard/checkpoint/export.py``.
  ``flatshard consolidate SRC OUT_DIR/`` writes them as a Hugging Face model directory (``--max-shard-size``,
  ``--dtype``): see ``flatshard/checkpoint/hf_export.py``.

Every path may also be an fsspec URL (``s3://bucket/run/last.ckpt``).
"""

from __future__ import annotations

import argparse
import os
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


def _inspect_sharded(path: str, show_all: bool) -> int:
    from flatshard.checkpoint import ShardedReader

    reader = ShardedReader(path)
    meta = reader.meta
    layout = reader.layout()
    extra = reader.read_extra(layout)
    print(f"sharded checkpoint: {path}")
    if reader.version:
        print(
            f"  format {meta['format']} v{meta['version']}, written by {meta['world_size']} ranks "
            f"(flatshard {meta['flatshard_version']}, torch {meta['torch_version']})"
        )
    else:
        print("  a torch.distributed.checkpoint directory written by another tool (torch FSDP, Lightning)")
    for key in ("epoch", "global_step", "pytorch-lightning_version"):
        if key in extra:
            print(f"  {key}: {extra[key]}")
    model = layout.model or {}
    aliases = layout.aliases
    numel = 0
    rows = []
    for key, fqn in model.items():
        if reader.is_object(fqn):
            rows.append((key, "object", ""))
            continue
        md = reader.tensor_meta(fqn)
        shape = str(tuple(reader.full_shape(fqn)))
        if key not in aliases and md is not None:
            numel += md.size.numel()
        dtype = str(md.properties.dtype).replace("torch.", "") if md is not None else "?"
        rows.append((key, shape, dtype + (f" (tied to {aliases[key]})" if key in aliases else "")))
    print(f"  state_dict: {len(model)} entries, {_human(numel)} elements")
    for key, shape, dtype in rows if show_all else rows[:20]:
        print(f"    {key:<60} {shape:<20} {dtype}")
    if not show_all and len(rows) > 20:
        print(f"    ... {len(rows) - 20} more (use --all)")
    for k, (_, state) in enumerate(layout.optimizers):
        print(f"  optimizer #{k}: state keys {sorted({key for _, key in state.values()})}")
    return 0


def _inspect(path: str, show_all: bool) -> int:
    from pathlib import Path

    from flatshard.checkpoint import CheckpointError, is_sharded_checkpoint, load_checkpoint_file, locate

    try:
        location = locate(path)
        if is_sharded_checkpoint(location) or (isinstance(location, Path) and location.is_dir()):
            return _inspect_sharded(path, show_all)
        ckpt = load_checkpoint_file(location)
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


def _consolidate(src: str, out: str) -> int:
    import time

    from flatshard.checkpoint import CheckpointError, consolidate, locate, size_of

    start = time.perf_counter()
    try:
        target = consolidate(src, out)
        size = size_of(locate(target))
    except (CheckpointError, FileNotFoundError, IsADirectoryError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {target} ({size / 2**20:.1f} MiB) in {time.perf_counter() - start:.1f}s")
    return 0


def _consolidate_to(args: argparse.Namespace) -> int:
    """``consolidate`` in the format OUT names: ``.ckpt`` as :func:`_consolidate`, ``.safetensors`` the model
    weights (see [Note: safetensors export]), ``OUT_DIR/`` the weights as a Hugging Face model directory (see
    [Note: Hugging Face model directory])."""
    import time

    from flatshard.checkpoint import CheckpointError, export_pretrained, export_safetensors, output_format

    start = time.perf_counter()
    ema: bool | str = args.ema_key or args.ema
    files = ""
    try:
        kind = output_format(args.out)
        if kind != "/" and (args.max_shard_size is not None or args.dtype is not None):
            raise CheckpointError(
                "--max-shard-size and --dtype shape a Hugging Face model directory. HINT: end the output with '/' "
                "(OUT_DIR/)."
            )
        if kind == ".ckpt":
            if args.prefix or ema:
                raise CheckpointError(
                    "--prefix, --ema and --ema-key select model weights for a .safetensors export; a .ckpt "
                    "output is the whole checkpoint. HINT: name the output OUT.safetensors (or OUT_DIR/)."
                )
            return _consolidate(args.src, args.out)
        if kind == "/":
            exported = export_pretrained(
                args.src,
                args.out,
                prefix=args.prefix,
                ema=ema,
                max_shard_size=args.max_shard_size or "5GB",
                dtype=args.dtype,
                progress=sys.stderr.isatty(),
            )
            path, tensors, nbytes, notes = exported.path, exported.tensors, exported.nbytes, exported.notes
            files = f", {len(exported.files)} files" if len(exported.files) > 1 else ", 1 file"
        else:
            result = export_safetensors(
                args.src, args.out, prefix=args.prefix, ema=ema, progress=sys.stderr.isatty()
            )
            path, tensors, nbytes, notes = result.path, result.tensors, result.nbytes, result.notes
    except (CheckpointError, FileNotFoundError, IsADirectoryError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}")
    print(
        f"wrote {path} ({nbytes / 2**20:.1f} MiB, {tensors} tensors{files}"
        f"{', EMA weights' if ema else ''}) in {time.perf_counter() - start:.1f}s"
    )
    return 0


def _size(text: str) -> str:
    """``--max-shard-size``: checked when parsed, passed on as given."""
    from flatshard.checkpoint import parse_max_shard_size

    try:
        parse_max_shard_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    return text


def _dtype(text: str) -> str:
    """``--dtype``: checked when parsed, passed on as given."""
    from flatshard.checkpoint import parse_dtype

    try:
        parse_dtype(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flatshard", description="flatshard checkpoint and planning tools")
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="summarise a checkpoint (full file or sharded directory)")
    inspect.add_argument("checkpoint", help="a .ckpt file or a sharded checkpoint directory (path or URL)")
    inspect.add_argument("--all", action="store_true", help="list every tensor, not only the first 20")
    consolidate = sub.add_parser(
        "consolidate",
        help="turn a sharded checkpoint directory into one full checkpoint file (.ckpt), or export the model "
        "weights (.safetensors, or a Hugging Face model directory OUT_DIR/)",
    )
    consolidate.add_argument(
        "src",
        help="sharded checkpoint directory (state_dict_type='sharded'): a path or a URL (s3://...); for a "
        ".safetensors or OUT_DIR/ output also a full .ckpt file",
    )
    consolidate.add_argument(
        "out",
        help="what to write, a path or a URL (replaced atomically if it exists); its suffix picks the format: "
        ".ckpt (the full checkpoint), .safetensors (the model weights only), or a trailing '/' (or an existing "
        "directory): the model weights as a Hugging Face model directory (model.safetensors, or "
        "model-0000k-of-0000n.safetensors and model.safetensors.index.json; other files there are kept)",
    )
    consolidate.add_argument(
        "--prefix",
        default="",
        help=".safetensors and OUT_DIR/ only: keep the names that start with PREFIX, without it (e.g. 'model.' "
        "for a LightningModule's self.model)",
    )
    consolidate.add_argument(
        "--ema",
        action="store_true",
        help=".safetensors and OUT_DIR/ only: export the EMA weights (ShardedEMA) instead",
    )
    consolidate.add_argument(
        "--max-shard-size",
        type=_size,
        default=None,
        help="OUT_DIR/ only: the size limit per file, as Hugging Face writes it: '5GB' (the default), '500MB', "
        "'2GiB', or bytes",
    )
    consolidate.add_argument(
        "--dtype",
        type=_dtype,
        default=None,
        help="OUT_DIR/ only: cast floating-point weights to this dtype (bfloat16, float16, float32)",
    )
    consolidate.add_argument(
        "--ema-key",
        default=None,
        help="with several EMA states: the callback state key to export (implies --ema)",
    )
    from flatshard.estimator.command import add_parser as add_estimate
    from flatshard.estimator.command import run as run_estimate

    add_estimate(sub)
    args = parser.parse_args(argv)
    if args.command == "estimate":
        return run_estimate(args)
    if args.command == "inspect":
        try:
            return _inspect(args.checkpoint, args.all)
        except BrokenPipeError:  # ``flatshard inspect X | head``: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
            return 0
    if args.command == "consolidate":
        return _consolidate_to(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
