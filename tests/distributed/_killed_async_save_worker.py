"""``_killed_save_worker.py``'s sharded loop with asynchronous saves, for ``test_killed_async_save.py``:

    python _killed_async_save_worker.py CKPT_PATH MARKER_DIR MAX_SAVES [--width W] [--kill RANK:write:SAVE]

2 gloo ranks save with :class:`flatshard.checkpoint.AsyncSaver` and train on while each save is written. Rank 0
writes ``expect-i.json`` before save ``i``, ``returned-i.json`` once it has returned (the write goes on in the
background) and ``done-i.json`` (digests of the completed directory's files) after waiting for it, which
happens before save ``i + 1`` starts.

``--width`` and ``--kill`` as in ``_killed_save_worker.py``: rank ``RANK``'s writer thread kills the process when
it starts writing save ``SAVE``'s data file; the other rank waits for that save at once (no training step in
between, whose collectives would fail first) and reports what the wait raised.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _killed_save_worker import (
    SHARDED_WORLD,
    _train_step,
    _write_marker,
    build_model,
    build_optimizer,
    file_digests,
    parse_args,
    parse_kill,
    save_while_killed,
    state_digest,
)

TRAIN_STEPS_WHILE_WRITING = 3


def _save_and_wait(saver: Any, checkpoint: dict[str, Any], path: str) -> None:
    saver.save(checkpoint, path)
    saver.wait()


def save_loop(rank: int, world: int, args: argparse.Namespace) -> None:
    import flatshard
    from flatshard.checkpoint import AsyncSaver
    from flatshard.engine import sharded_model_state_dict, sharded_optim_state_dict

    torch.set_num_threads(1)
    path, marker_dir, max_saves = args.path, args.marker_dir, args.max_saves
    killing = parse_kill(args.kill)
    model = build_model(args.width)
    flatshard.shard(model, auto_wrap_policy={nn.Linear})
    opt = build_optimizer(model)
    saver = AsyncSaver()
    step = 0
    for i in range(max_saves):
        model_state, optim_state = flatshard.get_state_dict(model, opt)  # full, on rank 0
        if rank == 0:
            _write_marker(
                marker_dir, f"expect-{i}.json", {"save": i, "state": state_digest(model_state, optim_state)}
            )
        del model_state, optim_state
        checkpoint = {
            "state_dict": sharded_model_state_dict(model),
            "optimizer_states": [sharded_optim_state_dict(model, opt)],
            "save": i,
        }
        if killing is not None and killing[2] == i:  # the kill happens in the writer thread this save starts
            save_while_killed(
                rank, marker_dir, killing, functools.partial(_save_and_wait, saver, checkpoint, path)
            )
            return
        saver.save(checkpoint, path)
        del checkpoint
        if rank == 0:
            _write_marker(marker_dir, f"returned-{i}.json", {"save": i})
        for _ in range(TRAIN_STEPS_WHILE_WRITING):  # changes the live state while the copy is written
            _train_step(model, opt, step, rank, world)
            step += 1
        saver.wait(collective=True)
        if rank == 0:
            _write_marker(marker_dir, f"done-{i}.json", {"save": i, "files": file_digests(path)})


def main() -> None:
    from flatshard.testing import spawn

    spawn(save_loop, SHARDED_WORLD, parse_args(sys.argv[1:], "path", "marker_dir"), timeout=600.0)


if __name__ == "__main__":
    main()
