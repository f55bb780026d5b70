"""Trains a model of a few hundred MB and saves it to the same path over and over, until it is killed.

Run by ``tests/distributed/test_killed_save.py`` as a script in a session of its own:

    python _killed_save_worker.py KIND CKPT_PATH MARKER_DIR MAX_SAVES [--width W] [--kill RANK:POINT:SAVE]

``KIND`` is ``full`` (one process, no process group: ``flatshard.save_checkpoint(state_dict_type="full")``) or
``sharded`` (2 gloo ranks started with ``flatshard.testing.spawn``, every rank writing its pieces). Before save
``i`` rank 0 writes ``MARKER_DIR/expect-i.json`` (digests of the full model and optimizer state being saved);
after it ``MARKER_DIR/done-i.json`` (digests of every file of the completed checkpoint). Marker files are
written under a temporary name and renamed, so a reader never sees half of one.

``--width`` sets the model's width (a smaller model saves faster). ``--kill RANK:POINT:SAVE`` runs 2 ranks (also
for ``full``) and makes rank ``RANK`` kill itself (SIGKILL) during save ``SAVE``: when it starts writing its data
file (``POINT`` ``write``) or during the full-state gather (``gather``). The other rank writes
``MARKER_DIR/survivor-<rank>.json`` with what that save raised and how long after the save began, then stops.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

WIDTH, DEPTH = 2048, 8  # 33.6M parameters: 134 MB of weights, the same again of SGD momentum
SHARDED_WORLD = 2


def build_model(width: int = WIDTH) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(DEPTH)])


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def tensor_digest(t: torch.Tensor) -> str:
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{t.dtype}:{tuple(t.shape)}:{hashlib.sha1(data).hexdigest()}"


def state_digest(model_state: dict[str, Any], optim_state: dict[str, Any]) -> dict[str, str]:
    """Digests of a full model state dict and a plain optimizer state dict (tensor by tensor)."""
    out = {f"model/{k}": tensor_digest(v) for k, v in model_state.items()}
    for idx, entries in optim_state["state"].items():
        for key, value in entries.items():
            out[f"optim/{idx}/{key}"] = (
                tensor_digest(value) if isinstance(value, torch.Tensor) else repr(value)
            )
    return out


def file_digests(path: str | os.PathLike[str]) -> dict[str, str]:
    """sha1 of the checkpoint file, or of every file of a checkpoint directory (by relative name)."""
    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    out = {}
    for f in files:
        h = hashlib.sha1()
        with open(f, "rb") as stream:
            for block in iter(lambda stream=stream: stream.read(1 << 22), b""):
                h.update(block)
        out[str(f.relative_to(p)) if p.is_dir() else f.name] = h.hexdigest()
    return out


def _write_marker(marker_dir: str, name: str, payload: dict[str, Any]) -> None:
    tmp = os.path.join(marker_dir, f"{name}.partial")
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, os.path.join(marker_dir, name))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world: int) -> None:
    width = model[0].in_features  # type: ignore[index]
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4 * world, width, generator=g)[rank * 4 : (rank + 1) * 4]
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def kill_self_at(point: str) -> None:
    """From now on, in this process, the first data file write (``write``) or the second unit of the full-state
    gather (``gather``) kills the process (SIGKILL: no cleanup, no last words)."""
    import torch.distributed.checkpoint as dcp

    from flatshard.engine.state.stream_gather import FlatStream

    def die(*args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "write":
        dcp.FileSystemWriter.write_data = die  # type: ignore[method-assign,assignment]
        return
    assert point == "gather", point
    real, calls = FlatStream.gather, {"n": 0}

    def gather(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:  # the first unit went through: the gather is under way
            die()
        return real(*args, **kwargs)

    FlatStream.gather = gather  # type: ignore[method-assign]


def report_survivor(marker_dir: str, rank: int, started: float, error: BaseException | None) -> None:
    """What the surviving rank's save raised, and after how many seconds."""
    _write_marker(
        marker_dir,
        f"survivor-{rank}.json",
        {
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "seconds": time.monotonic() - started,
        },
    )


def save_while_killed(
    rank: int, marker_dir: str, killing: tuple[int, str, int], save: Callable[[], Any]
) -> None:
    """Run ``save`` as rank ``killing[0]`` kills itself at ``killing[1]``; the surviving rank reports what it
    raised (``report_survivor``)."""
    if rank == killing[0]:
        kill_self_at(killing[1])
    started, error = time.monotonic(), None
    try:
        save()
    except Exception as err:
        error = err
    report_survivor(marker_dir, rank, started, error)


def parse_kill(kill: str | None) -> tuple[int, str, int] | None:
    if kill is None:
        return None
    rank, point, save = kill.split(":")
    return int(rank), point, int(save)


def save_loop(
    rank: int,
    world: int,
    kind: str,
    path: str,
    marker_dir: str,
    max_saves: int,
    width: int = WIDTH,
    kill: str | None = None,
) -> None:
    import flatshard

    torch.set_num_threads(1)
    model = build_model(width)
    flatshard.shard(model, auto_wrap_policy={nn.Linear})
    opt = build_optimizer(model)
    killing = parse_kill(kill)
    for i in range(max_saves):
        _train_step(model, opt, i, rank, world)
        model_state, optim_state = flatshard.get_state_dict(model, opt)  # full, on rank 0
        if rank == 0:
            _write_marker(
                marker_dir, f"expect-{i}.json", {"save": i, "state": state_digest(model_state, optim_state)}
            )
        del model_state, optim_state
        if killing is not None and killing[2] == i:
            save = functools.partial(
                flatshard.save_checkpoint, path, model, opt, state_dict_type=kind, extra={"save": i}
            )
            save_while_killed(rank, marker_dir, killing, save)
            return
        flatshard.save_checkpoint(path, model, opt, state_dict_type=kind, extra={"save": i})
        if rank == 0:
            _write_marker(marker_dir, f"done-{i}.json", {"save": i, "files": file_digests(path)})


def parse_args(argv: list[str], *positional: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    for name in positional:
        parser.add_argument(name)
    parser.add_argument("max_saves", type=int)
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--kill", default=None)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args(sys.argv[1:], "kind", "path", "marker_dir")
    run = (args.kind, args.path, args.marker_dir, args.max_saves, args.width, args.kill)
    if args.kind == "full" and args.kill is None:
        save_loop(0, 1, *run)
    elif args.kind in ("sharded", "full"):
        from flatshard.testing import spawn

        spawn(save_loop, SHARDED_WORLD, *run, timeout=600.0)
    else:
        raise SystemExit(f"unknown kind {args.kind!r}")


if __name__ == "__main__":
    main()
