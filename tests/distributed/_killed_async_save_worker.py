"""``_killed_save_worker.py``'s sharded loop with asynchronous saves, for ``test_killed_async_save.py``:

    python _killed_async_save_worker.py CKPT_PATH MARKER_DIR MAX_SAVES

2 gloo ranks save with :class:`flatshard.checkpoint.AsyncSaver` and train on while each save is written. Rank 0
writes ``expect-i.json`` before save ``i``, ``returned-i.json`` once it has returned (the write goes on in the
background) and ``done-i.json`` (digests of the completed directory's files) after waiting for it, which
happens before save ``i + 1`` starts.
"""

from __future__ import annotations

import os
import sys

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
    state_digest,
)

TRAIN_STEPS_WHILE_WRITING = 3


def save_loop(rank: int, world: int, path: str, marker_dir: str, max_saves: int) -> None:
    import flatshard
    from flatshard.checkpoint import AsyncSaver
    from flatshard.engine import sharded_model_state_dict, sharded_optim_state_dict

    torch.set_num_threads(1)
    model = build_model()
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

    path, marker_dir, max_saves = sys.argv[1], sys.argv[2], int(sys.argv[3])
    spawn(save_loop, SHARDED_WORLD, path, marker_dir, max_saves, timeout=600.0)


if __name__ == "__main__":
    main()
