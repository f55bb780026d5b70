"""Whole-tensor optimizer state in checkpoints: in pieces while a save reads it, whole on the owners after a load.

[Note: saving whole-tensor optimizer state]
Between steps a whole-tensor optimizer's state for a sharded parameter is whole, on the parameter's owner only
(see [Note: whole-tensor optimizers] in ``flatshard.engine.step.whole_tensor``). Every checkpoint path (full
files, streamed or not, sharded directories, resharding on load) handles optimizer state laid out like the
parameters' pieces, as an elementwise optimizer keeps it. So while the state is read for a save, each state tensor
shaped like its parameter is cut into those pieces and sent to the ranks holding them (one all-to-all per shard
group); the owner's whole tensors are put back afterwards, unchanged. After a load, the pieces every rank
received go to the owners (one all-to-all) and are whole again. A checkpoint of such an optimizer is therefore the
one an elementwise optimizer's would be: the plain format in a full file, DCP-native pieces in a directory,
loadable on any world size and under DDP. State tensors of another shape (Adafactor's row and column statistics,
Shampoo's preconditioners of a non-square matrix) cannot be cut like the parameter: the owner broadcasts them for
the save, so that they are replicated state like ``step`` (whole in a full file, one whole tensor in a directory),
each rank holding them whole while the save reads them. A loader that puts such a tensor in whole (its shape is not
the parameter's) says so (:func:`note_loaded_whole`); :func:`after_load` keeps it on the owner only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from flatshard.engine.step.whole_exchange import Entry, agree_on, from_owners, to_owners
from flatshard.engine.step.whole_plan import WholeGroup, WholeState, WholeTensorPlan, existing_plan, plan_for
from flatshard.engine.step.whole_tensor import is_whole_tensor_optimizer
from flatshard.engine.transport import watchdog

__all__ = ["after_load", "note_loaded_whole", "states_as_pieces", "whole_state_keys"]


def _state_plan(optimizer: torch.optim.Optimizer, doing: str) -> WholeTensorPlan | None:
    """The optimizer's plan with every parameter a piece (after a step that raised, put back), or ``None`` when the
    optimizer needs no whole tensors or has no sharded parameters."""
    if not is_whole_tensor_optimizer(optimizer):
        return None
    plan = plan_for(optimizer)
    if not plan.groups:
        return None
    plan.recover()
    for q in plan.params():
        q.check_state(WholeState.PIECE, doing=doing)
    return plan


@contextmanager
def states_as_pieces(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Within the block the optimizer's state of its sharded parameters is in pieces on every rank (collective;
    see [Note: saving whole-tensor optimizer state]). Tensors read inside stay valid after it."""
    plan = _state_plan(optimizer, "reading the optimizer state for a save")
    if plan is None:
        yield
        return
    stashed: dict[int, tuple[torch.nn.Parameter, dict[str, Any] | None]] = {}
    whole_keys: set[tuple[int, str]] = set()
    try:  # the owners' whole state comes back even if a collective of the conversion raised
        for g in plan.groups:
            _group_as_pieces(optimizer, g, stashed, whole_keys)
        plan.saving_whole = whole_keys
        yield
    finally:
        plan.saving_whole = set()
        for p, whole in stashed.values():
            if whole is not None:
                optimizer.state[p] = whole
            else:
                optimizer.state.pop(p, None)


def _group_as_pieces(
    optimizer: torch.optim.Optimizer,
    g: WholeGroup,
    stashed: dict[int, tuple[torch.nn.Parameter, dict[str, Any] | None]],
    whole_keys: set[tuple[int, str]],
) -> None:
    """One shard group's part of :func:`states_as_pieces`: the owners' state in ``stashed``, pieces (and
    replicated tensors of other shapes, noted in ``whole_keys``) in the optimizer's state."""
    meta: dict[int, dict[str, Any]] = {}
    for n, q in enumerate(g.params):
        state = optimizer.state.get(q.param) if q.owned else None
        if not state:
            continue
        entry: dict[str, Any] = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.shape == q.shape and value.dim() > 0:
                entry[key] = ("piece", value.dtype)
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                entry[key] = ("whole", value.dtype, tuple(value.shape))
            else:
                entry[key] = ("value", value)
        meta[n] = entry
    merged: list[dict[int, dict[str, Any]]] = [{} for _ in range(g.world)]
    dist.all_gather_object(merged, meta, group=g.group)
    everyone = {n: e for part in merged for n, e in part.items()}
    dtypes = sorted(
        {kind[1] for e in everyone.values() for kind in e.values() if kind[0] == "piece"}, key=str
    )
    pieces: dict[tuple[int, str], torch.Tensor] = {}
    for dtype in dtypes:
        keyed = [
            (n, key)
            for n, e in sorted(everyone.items())
            for key, kind in sorted(e.items())
            if kind[0] == "piece" and kind[1] == dtype
        ]
        entries: list[Entry] = [
            (
                g.params[n],
                optimizer.state[g.params[n].param][key].reshape(-1) if g.params[n].owned else None,
            )
            for n, key in keyed
        ]
        for k, piece in from_owners(g, entries, dtype, "optimizer state pieces for a save").items():
            pieces[keyed[k]] = piece.to(g.params[keyed[k][0]].handle.sharded.device)
    for n, e in sorted(everyone.items()):  # other shapes: the owner's tensor, replicated
        q = g.params[n]
        for key, kind in sorted(e.items()):
            if kind[0] != "whole":
                continue
            mine = optimizer.state[q.param][key] if q.owned else None
            box = (
                mine.to(g.device)
                if mine is not None
                else torch.empty(kind[2], dtype=kind[1], device=g.device)
            )
            work = dist.broadcast(
                box, src=dist.get_global_rank(g.group, q.owner), group=g.group, async_op=True
            )
            watchdog.wait_collective(
                work, "broadcast of whole optimizer state for a save", g.group, "broadcast"
            )
            pieces[(n, key)] = mine if mine is not None else box.to(q.handle.sharded.device)
            whole_keys.add((id(q.param), key))
    for n, e in everyone.items():
        q = g.params[n]
        stashed[id(q.param)] = (q.param, optimizer.state.get(q.param) if q.owned else None)
        optimizer.state[q.param] = {
            key: pieces[(n, key)] if kind[0] in ("piece", "whole") else kind[1] for key, kind in e.items()
        }


def whole_state_keys(optimizer: torch.optim.Optimizer) -> set[tuple[int, str]]:
    """Inside :func:`states_as_pieces`: ``(id(parameter), key)`` of the state tensors of sharded parameters that
    are whole (not shaped like their parameter, so not cut into pieces) and replicated on every rank."""
    plan = existing_plan(optimizer)
    return set(plan.saving_whole) if plan is not None else set()


def note_loaded_whole(optimizer: torch.optim.Optimizer, keys: set[tuple[int, str]]) -> None:
    """A loader's record, for the next :func:`after_load`: ``(id(parameter), key)`` of the state tensors of sharded
    parameters it put in whole (not cut like their parameter)."""
    if is_whole_tensor_optimizer(optimizer):
        plan_for(optimizer).loaded_whole = set(keys)


def after_load(optimizer: torch.optim.Optimizer) -> None:
    """After a load put state in pieces into the optimizer on every rank: make it whole on the owners again
    (collective; see [Note: saving whole-tensor optimizer state]). State the loader put in whole (see
    :func:`note_loaded_whole`) stays whole on the owner and is dropped elsewhere."""
    kept = existing_plan(optimizer)
    loaded_whole = kept.loaded_whole if kept is not None else set()
    if kept is not None:
        kept.loaded_whole = set()
    plan = _state_plan(optimizer, "making loaded optimizer state whole on the owners")
    if plan is None:
        return
    for g in plan.groups:
        loaded = [(n, q) for n, q in enumerate(g.params) if optimizer.state.get(q.param)]
        keys: dict[int, list[str]] = {}
        problem = None
        for n, q in loaded:
            keys[n] = []
            for k, v in sorted(optimizer.state[q.param].items()):
                if not isinstance(v, torch.Tensor) or v.dim() == 0 or (id(q.param), k) in loaded_whole:
                    continue
                if v.numel() != q.counts[g.rank] and problem is None:
                    problem = (
                        f"{plan.optimizer_name}'s loaded state {k!r} of sharded parameter {q.name!r} (shape "
                        f"{tuple(q.shape)}) has {v.numel()} elements on rank {g.rank} of its shard group, its piece "
                        f"{q.counts[g.rank]}. HINT: load optimizer state through flatshard.load_checkpoint or "
                        "flatshard.set_state_dict, which cut it for this layout."
                    )
                keys[n].append(k)
        what = f"making {plan.optimizer_name}'s loaded state whole"
        items = [(q.name, k, str(optimizer.state[q.param][k].dtype)) for n, q in loaded for k in keys[n]]
        agree_on(g, items, what, problem)  # see [Note: the ranks agree before an all-to-all]
        dtypes = sorted({optimizer.state[q.param][k].dtype for n, q in loaded for k in keys[n]}, key=str)
        wholes: dict[tuple[int, str], torch.Tensor] = {}
        for dtype in dtypes:
            keyed = [(n, k) for n, q in loaded for k in keys[n] if optimizer.state[q.param][k].dtype == dtype]
            entries: list[Entry] = [
                (g.params[n], optimizer.state[g.params[n].param][k].reshape(-1)) for n, k in keyed
            ]
            for i, whole in to_owners(g, entries, dtype, "loaded optimizer state to its owners").items():
                wholes[keyed[i]] = whole
        for n, q in loaded:
            if not q.owned:
                del optimizer.state[q.param]
                continue
            state = optimizer.state[q.param]
            for k in keys[n]:
                state[k] = wholes[(n, k)].view(q.shape).to(q.handle.sharded.device)
