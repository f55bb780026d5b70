"""Nothing of a freed model or a destroyed process group stays in the process (see [Note: state per process group]).

Two gloo ranks, in one process each: models are sharded, stepped and freed one after another (FULL_SHARD with a
full state gather, SHARD_GRAD_OP, HYBRID_SHARD on groups made for it, a model on a process group of its own, one stepped by
torch's Muon, a whole-tensor optimizer), the default group is destroyed, an estimate runs on its fake group, and
a new default group of the same name is made. After each ``del`` and ``gc.collect()``:

- no instance of a flatshard class is left but those of the live process groups (their state, the shared-memory
  channel and its segments, the desync monitor), found with ``gc.get_objects()``, and nothing grows from one
  model to the next;
- no ``flatshard-*`` thread runs but the live groups' (their channels' workers, the heartbeat);
- no segment of ours is mapped (``memfd:flatshard`` in ``/proc/self/maps``) once its group is gone, and no
  ``flatshard-*`` name is in ``/dev/shm``;
- a new process group of the same name starts with the default desync limit, not the one of an earlier group
  (the estimate's ``None``, the models' own).

And each model's loss after its optimizer step equals the unsharded reference's on the global batch.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import flatshard
from flatshard.engine.transport import watchdog
from flatshard.engine.transport.groups import live, state_of
from flatshard.estimator import estimate
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch
from tests.estimate.models import gpt

from ..exact_muon import use_float32_newton_schulz

use_float32_newton_schulz()  # exact parity for Muon: see tests/exact_muon.py

PER_RANK = 2
LIMIT = 30.0  # the models' desync_timeout: not the default, so a leaked one shows
# What a live process group owns (see [Note: state per process group]): allowed while that group lives.
PER_GROUP = {"GroupState", "ShmGroup", "Segment", "Monitor"}


def _ours() -> Counter[str]:
    """Instances of flatshard's classes in this process, by class name (module constants excepted by the caller,
    which compares with a count taken before)."""
    gc.collect()
    return Counter(
        type(o).__name__
        for o in gc.get_objects()
        if str(getattr(type(o), "__module__", "")).startswith("flatshard.")
        and not isinstance(o, ctypes.Array)
    )


def _threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("flatshard"))


def _mapped_segments() -> int:
    with open("/proc/self/maps") as f:
        return sum("memfd:flatshard" in line for line in f)


def _named_segments() -> list[str]:
    return (
        [n for n in os.listdir("/dev/shm") if n.startswith("flatshard")] if os.path.isdir("/dev/shm") else []
    )


def _settled(check: Any, timeout: float = 5.0) -> Any:
    """``check()`` once the threads stopped by a release have ended (they are joined with a timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if not value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def _step_loss(model: nn.Module, optimizers: list[torch.optim.Optimizer], rank: int, world: int) -> float:
    """One step on this rank's slice of the global batch, then the loss on the whole batch after it."""
    idx, target = make_batch(0, PER_RANK * world)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    model.loss(idx[mine], target[mine]).backward()  # type: ignore[operator]
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        return float(model.loss(idx, target))  # type: ignore[operator]


def _reference_loss(reference: nn.Module, make_optimizers: Any, world: int) -> float:
    model = copy.deepcopy(reference)
    optimizers = make_optimizers(model)
    idx, target = make_batch(0, PER_RANK * world)
    loss = sum(
        model.loss(idx[i : i + PER_RANK], target[i : i + PER_RANK]) for i in range(0, len(idx), PER_RANK)
    )
    (loss / world).backward()  # the mean over ranks of the ranks' mean losses, as the reduction averages
    for opt in optimizers:
        opt.step()
    with torch.no_grad():
        return float(model.loss(idx, target))


def _adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.AdamW(model.parameters(), lr=1e-2)]


def _muon(model: nn.Module) -> list[torch.optim.Optimizer]:
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and n.startswith("blocks."))]
    return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-2)]


def _cycle(
    rank: int,
    world: int,
    reference: nn.Module,
    make_optimizers: Any,
    full_state: bool = False,
    **options: Any,
) -> float:
    """Shard a copy of ``reference``, step it, check its loss against the unsharded one; return the difference."""
    model = copy.deepcopy(reference)
    optimizers = make_optimizers(model)  # before shard(): Muon picks the matrices by their shapes
    flatshard.shard(model, auto_wrap_policy={Block}, desync_timeout=LIMIT, **options)
    loss = _step_loss(model, optimizers, rank, world)
    if full_state:  # the streamed gather: shared-memory segments and prefault threads of its own
        state, _ = flatshard.get_state_dict(model, optimizers[0])
        assert rank != 0 or set(state) == set(reference.state_dict())
        del state
    del model, optimizers
    return abs(loss - _reference_loss(reference, make_optimizers, world))


def _check_nothing_but_groups(baseline: Counter[str], label: str) -> Counter[str]:
    now = _ours()
    grown = {k: now[k] - baseline[k] for k in now if now[k] > baseline[k] and k not in PER_GROUP}
    assert not grown, f"{label}: left behind {grown}"
    channels = sum(1 for _, s in live() if s.channel is not None)
    assert now["ShmGroup"] <= channels, f"{label}: {now['ShmGroup']} channels for {channels} live groups"
    return now


def _run(rank: int, world: int, store_dir: str) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = TinyGPT(n_layer=2)
    diffs: dict[str, float] = {}
    empty = _ours()  # nothing sharded yet, no group state
    assert not _threads() and not _mapped_segments()
    first_name = dist.group.WORLD.group_name

    # Models on the default group, one after another: nothing grows past the group's own state.
    diffs["full_shard"] = _cycle(rank, world, reference, _adamw, full_state=True)
    after_first = _check_nothing_but_groups(empty, "FULL_SHARD")
    threads = _threads()
    assert set(threads) <= {"flatshard-shm", "flatshard-heartbeat"}, threads
    diffs["shard_grad_op"] = _cycle(rank, world, reference, _adamw, sharding_strategy="SHARD_GRAD_OP")
    assert _check_nothing_but_groups(empty, "SHARD_GRAD_OP") == after_first  # nothing grows
    assert _settled(lambda: _threads() != threads) is False, _threads()

    # A model on a group of its own: its state, channel, thread and segments go when the group does.
    group = dist.new_group(list(range(world)))
    diffs["own_group"] = _cycle(rank, world, reference, _adamw, process_group=group)
    assert len(_threads()) == len(threads) + 1  # its channel's worker
    dist.destroy_process_group(group)
    del group
    assert _ours() == after_first, "the destroyed group's state stayed"
    assert _settled(lambda: _threads() != threads) is False, _threads()

    # Hybrid sharding over a (shard, replicate) pair of groups made for it: both go when destroyed.
    shard_group = dist.new_group(list(range(world)))
    replicas = [dist.new_group([r]) for r in range(world)]
    diffs["hybrid"] = _cycle(
        rank,
        world,
        reference,
        _adamw,
        sharding_strategy="HYBRID_SHARD",
        process_group=(shard_group, replicas[rank]),
    )
    for g in (shard_group, *replicas):
        dist.destroy_process_group(g)
    del shard_group, replicas, g
    assert _ours() == after_first, "the hybrid groups' state stayed"

    # The default group destroyed: nothing of ours at all.
    dist.destroy_process_group()
    out: dict[str, Any] = {}
    out["after_world"] = dict(_ours() - empty)
    out["threads_after_world"] = _settled(_threads)
    out["mapped_after_world"] = _settled(_mapped_segments)

    # An estimate on a fake group of the same name: nothing of it stays either. Rank 0's measures the runtime in
    # processes of its own (see [Note: a rank's runtime]); rank 1's counts tensors alone, which halves the cost.
    overhead = None if rank == 0 else 0
    rows = estimate(gpt, [world], device="cpu", auto_wrap_policy={Block}, overhead=overhead)
    assert [r.world_size for r in rows.rows] == [world]
    del rows
    out["after_estimate"] = dict(_ours() - empty)
    out["threads_after_estimate"] = _threads()

    # A new default group of that name starts from the defaults, and a whole-tensor optimizer's model leaves
    # nothing either.
    store = dist.FileStore(str(Path(store_dir) / "second"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    out["same_name"] = dist.group.WORLD.group_name == first_name
    state = state_of(None)
    out["fresh_limit"] = (not state.limit_set, watchdog.group_limit(state), watchdog.limit())
    del state
    if hasattr(torch.optim, "Muon"):
        diffs["muon"] = _cycle(rank, world, reference, _muon)
    _check_nothing_but_groups(empty, "Muon")
    dist.barrier()
    dist.destroy_process_group()
    out["after_second"] = dict(_ours() - empty)
    out["threads_after_second"] = _settled(_threads)
    out["mapped_after_second"] = _settled(_mapped_segments)
    out["named"] = _named_segments()
    out["diffs"] = diffs
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_freed_models_and_destroyed_groups_leave_nothing(tmp_path: Path) -> None:
    for rank, out in enumerate(spawn(_run, 2, str(tmp_path), timeout=240)):
        for key in ("after_world", "after_estimate", "after_second"):
            assert out[key] == {}, (rank, key, out[key])
        for key in ("threads_after_world", "threads_after_estimate", "threads_after_second"):
            assert out[key] == [], (rank, key, out[key])
        assert out["mapped_after_world"] == out["mapped_after_second"] == 0, (rank, out)
        assert out["named"] == [], (rank, out["named"])
        assert out["same_name"], "the new default group should reuse the name (the case that leaked before)"
        assert out["fresh_limit"] == (True, watchdog.DEFAULT_LIMIT_S, watchdog.DEFAULT_LIMIT_S), out[
            "fresh_limit"
        ]
        for name, diff in out["diffs"].items():
            assert diff < 1e-5, (rank, name, diff)
