"""``join``: evaluation loops whose ranks run different numbers of forwards complete, as under DDP.

[Note: joining uneven evaluation loops]
Under DDP a forward has no collectives, so ranks may run different numbers of evaluation batches (a
hand-made split, ``use_distributed_sampler=False``) and meet again at the epoch-end metric reduction. Here
every unit's forward all-gathers over its shard group: a rank that runs out of batches would leave the
others waiting in an all-gather while it waits in the metric reduction. Inside :func:`join`:

* before a unit's all-gather is issued (in forward or as a prefetch), the ranks of its shard group exchange
  one small integer each (an ``all_gather`` of 8 bytes): the unit's index, or ``-1`` from a rank that has
  finished. Ranks that run a forward must name the same unit; if they do not, their forwards diverged and
  every one of them raises, naming each rank's unit, instead of exchanging the wrong shards;
* a rank that leaves the ``join`` block (its batches are done) keeps answering: it sends ``-1``, and when
  the others name a unit it takes part in that unit's all-gather with its own shard and frees the result,
  until every rank of the group has left the block. Then all of them go on together.

The cost is one tiny collective per unit gather inside the block (evaluation only). Forwards inside must
run without gradients (``torch.no_grad()`` / ``inference_mode``): a backward's reduce-scatters are not served.
Groups are per shard group: under hybrid sharding each shard group joins on its own; with one rank per
shard group (NO_SHARD) forwards have no collective and nothing needs serving.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from flatshard.engine.runtime import RootContext, UnitState, get_unit_state, unit_states
from flatshard.engine.transport.comm import global_rank, uses_nccl

__all__ = ["JoinState", "begin_join", "end_join", "join"]

_DONE = -1


class JoinState:
    """One ``join`` block of a root: the shard group its units gather over, and the exchange."""

    def __init__(self, root: UnitState, group: Any, world: int, device: torch.device) -> None:
        self.root = root
        self.group = group
        self.world = world
        self.device = device
        self._names = {m: n or "<root>" for n, m in root.module.named_modules()}

    def _exchange(self, value: int) -> list[int]:
        mine = torch.tensor([value], dtype=torch.int64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine, group=self.group)
        return [int(t.item()) for t in out]

    def _describe(self, ctx: RootContext, index: int) -> str:
        if index == _DONE:
            return "finished (serving the others)"
        module = ctx.states[index].module
        return f"unit {index} ({self._names.get(module, type(module).__name__)})"

    def _agree(self, ctx: RootContext, values: list[int]) -> int:
        """The unit the running ranks gather next (``-1``: every rank has finished)."""
        named = {v for v in values if v != _DONE}
        if len(named) > 1:
            ranks = dist.get_process_group_ranks(self.group) if self.group is not None else range(self.world)
            where = "; ".join(f"rank {r}: {self._describe(ctx, v)}" for r, v in zip(ranks, values))
            raise RuntimeError(
                f"[rank {global_rank()}] flatshard.join: the ranks' forwards diverged, they gather different units "
                f"({where}). HINT: inside join every rank must run the same model's forward on its batches; "
                "a data-dependent branch that skips a unit on some ranks cannot be joined."
            )
        return named.pop() if named else _DONE

    def announce(self, ctx: RootContext, state: UnitState) -> None:
        """Called before ``state``'s all-gather is issued on a running rank."""
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"[rank {global_rank()}] flatshard.join covers forwards without gradients (evaluation), but "
                f"{type(state.module).__name__} gathers with gradients enabled. HINT: run the loop under "
                "torch.no_grad() or torch.inference_mode(), or leave the join block to train."
            )
        self._agree(ctx, self._exchange(ctx.states.index(state)))

    def serve(self) -> None:
        """This rank is done: take part in the others' gathers until every rank of the group is done."""
        root = self.root
        if root.ctx is None or root.ctx.root is not root:
            root._lazy_init()  # a rank that ran no forward at all
        ctx = root.ctx
        assert ctx is not None
        while True:
            index = self._agree(ctx, self._exchange(_DONE))
            if index == _DONE:
                return
            served = ctx.states[index]
            with torch.no_grad():
                for handle in served.handles:
                    handle.where = (served.path, "joined (serving another rank's gather)", ctx.step)
                    handle.unshard(ctx.streams, ctx.limiter)
                for handle in served.handles:
                    handle.wait_unshard(ctx.streams)
                served.reshard()


def _shard_group(states: list[UnitState]) -> tuple[Any, int, torch.device] | None:
    """The one shard group the units gather over (``None`` when no unit gathers)."""
    handles = [h for s in states for h in s.handles if h.shard_world > 1]
    if not handles:
        return None
    groups = {id(h.shard_group) for h in handles}
    if len(groups) > 1:
        raise ValueError(
            "flatshard.join needs every unit of the model to shard over the same process group; this model's "
            "units use several. HINT: shard every unit over the same group (the same process_group / "
            "shard_group_size in every shard() call)."
        )
    first = handles[0]
    # The exchanged integers go where the group's backend takes them: CUDA with NCCL, else the CPU.
    device = first.device if uses_nccl(first.shard_group) else torch.device("cpu")
    return first.shard_group, first.shard_world, device


def begin_join(module: nn.Module) -> JoinState | None:
    """Start joining ``module``'s forwards (see :func:`join`); ``None`` when none of them communicates."""
    root = get_unit_state(module)
    inner = getattr(module, "module", None)  # a wrapper's module (Fabric's _FabricModule, DDP-style wrappers)
    if root is None and isinstance(inner, nn.Module):
        root = get_unit_state(inner)
    if root is None:
        raise ValueError(
            f"flatshard.join needs the module given to flatshard.shard (a root unit), got {type(module).__name__}. "
            "HINT: pass the sharded model itself."
        )
    found = _shard_group(unit_states(root.module))
    if found is None:
        return None
    state = JoinState(root, *found)
    if root.ctx is None or root.ctx.root is not root:
        root._lazy_init()
    assert root.ctx is not None
    # every rank is here together: the forwards inside use these scales (see [Note: float8 all-gathers])
    if root.ctx.float8:
        root.ctx.float8.refresh(root.ctx.step)
    root.join = state
    return state


def end_join(state: JoinState | None, serve: bool = True) -> None:
    """Leave a join block: serve the other ranks until all are done (unless an error is leaving it)."""
    if state is None:
        return
    try:
        if serve:
            state.serve()
    finally:
        state.root.join = None


@contextmanager
def join(module: nn.Module) -> Iterator[None]:
    """Run an evaluation loop whose ranks may run different numbers of forwards; see [Note: joining uneven
    evaluation loops].

    Enter it on every rank around the loop; forwards inside run without gradients. A rank that leaves the
    block early keeps serving the others' all-gathers until every rank has left it::

        with torch.no_grad(), flatshard.join(model):
            for batch in my_shard_of_the_data:   # any number of batches per rank
                metric.update(model(batch))
        metric.compute()                          # every rank gets here together

    Args:
        module: the module given to ``flatshard.shard`` (the root unit).
    """
    state = begin_join(module)
    ok = False
    try:
        yield
        ok = True
    finally:
        end_join(state, serve=ok)
