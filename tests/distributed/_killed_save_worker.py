"""Trains a model of a few hundred MB and saves it to the same path over and over, until it is killed.

Run by ``tests/distributed/test_killed_save.py`` as a script in a session of its own:

    python _killed_save_worker.py KIND CKPT_PATH MARKER_DIR MAX_SAVES

``KIND`` is ``full`` (one process, no process group: ``flatshard.save_checkpoint(state_dict_type="full")``) or
``sharded`` (2 gloo ranks started with ``flatshard.testing.spawn``, every rank writing its pieces). Before save
``i`` rank 0 writes ``MARKER_DIR/expect-i.json`` (digests of the full model and optimizer state being saved);
after it ``MARKER_DIR/done-i.json`` (digests of every file of the completed checkpoint). Marker files are
written under a temporary name and renamed, so a reader never sees half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

WIDTH, DEPTH = 2048, 8  # 33.6M parameters: 134 MB of weights, the same again of SGD momentum
SHARDED_WORLD = 2


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


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
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4 * world, WIDTH, generator=g)[rank * 4 : (rank + 1) * 4]
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def save_loop(rank: int, world: int, kind: str, path: str, marker_dir: str, max_saves: int) -> None:
    import flatshard

    torch.set_num_threads(1)
    model = build_model()
    flatshard.shard(model, auto_wrap_policy={nn.Linear})
    opt = build_optimizer(model)
    for i in range(max_saves):
        _train_step(model, opt, i, rank, world)
        model_state, optim_state = flatshard.get_state_dict(model, opt)  # full, on rank 0
        if rank == 0:
            _write_marker(
                marker_dir, f"expect-{i}.json", {"save": i, "state": state_digest(model_state, optim_state)}
            )
        del model_state, optim_state
        flatshard.save_checkpoint(path, model, opt, state_dict_type=kind, extra={"save": i})
        if rank == 0:
            _write_marker(marker_dir, f"done-{i}.json", {"save": i, "files": file_digests(path)})


def main() -> None:
    kind, path, marker_dir, max_saves = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    if kind == "full":
        save_loop(0, 1, kind, path, marker_dir, max_saves)
    elif kind == "sharded":
        from flatshard.testing import spawn

        spawn(save_loop, SHARDED_WORLD, kind, path, marker_dir, max_saves, timeout=600.0)
    else:
        raise SystemExit(f"unknown kind {kind!r}")


if __name__ == "__main__":
    main()
