"""A whole-tensor optimizer's plan: its sharded parameters, their owners, and where each parameter stands.

See [Note: whole-tensor optimizers] in ``flatshard.engine.step.whole_tensor``. One :class:`WholeTensorPlan` is made
per optimizer and kept on the optimizer itself (the attribute ``_flatshard_whole_tensor``), so it lives and dies
with it; each :class:`WholeParam` holds one parameter's owner, the layout of its pieces, the owner's copy of its
value and its :class:`WholeState`, whose transitions :meth:`WholeParam.move_to` checks.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
import torch.nn as nn

from flatshard.engine.handle import FlatParamHandle, handle_of_param

__all__ = [
    "WholeGroup",
    "WholeParam",
    "WholeState",
    "WholeTensorPlan",
    "assign_owners",
    "cost",
    "digest",
    "existing_plan",
    "plan_for",
]

_ATTR = "_flatshard_whole_tensor"  # the optimizer's attribute holding its plan


class WholeState(enum.Enum):
    """Where one sharded parameter of a whole-tensor optimizer stands on this rank."""

    # Between steps: ``.data`` and ``.grad`` are this rank's 1-D pieces, views of the unit's shards.
    PIECE = "a piece"
    # Inside the step, on the parameter's owner: ``.data`` and ``.grad`` are the whole tensors.
    WHOLE_ON_OWNER = "whole on its owner"
    # Inside the step, on every other rank: ``.grad`` is ``None``, so the optimizer skips the parameter here.
    SKIPPED_ON_NON_OWNER = "skipped on a non-owner"


# Each state and the states it may move to: into a step and back (also back after a step that raised).
_NEXT: Mapping[WholeState, tuple[WholeState, ...]] = MappingProxyType(
    {
        WholeState.PIECE: (WholeState.WHOLE_ON_OWNER, WholeState.SKIPPED_ON_NON_OWNER),
        WholeState.WHOLE_ON_OWNER: (WholeState.PIECE,),
        WholeState.SKIPPED_ON_NON_OWNER: (WholeState.PIECE,),
    }
)


@dataclass(eq=False)
class WholeParam:
    """One sharded parameter of a whole-tensor optimizer, on this rank."""

    param: nn.Parameter
    handle: FlatParamHandle
    index: int  # in the handle's parameters
    name: str
    owner: int  # rank in the shard group
    rank: int  # this rank in the shard group
    shape: torch.Size
    counts: list[int]  # elements of this parameter in each rank's shard, by group rank
    starts: list[int]  # where each rank's elements begin in the flattened parameter
    state: WholeState = WholeState.PIECE
    # outside PIECE: the gradient piece ``.grad`` gets back after the step
    grad_piece: torch.Tensor | None = None
    whole: torch.Tensor | None = None  # on the owner: the whole value its last step left (the pieces' source)
    # version_mark() as the last step left the piece (None: no step yet)
    mark: tuple[int, int, int] | None = None

    @property
    def owned(self) -> bool:
        return self.owner == self.rank

    def piece(self) -> torch.Tensor:
        """This rank's piece of the parameter: a view of the unit's shard."""
        return self.handle.piece(self.index)

    def version_mark(self) -> tuple[int, int, int]:
        """What tells that this rank's piece was written: the shard's identity and the version counters of the
        shard (shared by every view of it: an in-place write through ``handle.sharded``, ``piece()`` or a
        ``.detach()`` of either bumps it) and of the parameter (``with torch.no_grad(): p.mul_(...)``). A write
        through ``p.data`` bumps neither: see 4. of [Note: whole-tensor optimizers]. Any write into the shard moves
        the marks of all its parameters (a load of one of them, another whole-tensor optimizer's write-back): their
        values are sent again, never wrongly kept."""
        sharded = self.handle.sharded
        return (id(sharded), sharded._version, self.param._version)

    def check_state(self, *expected: WholeState, doing: str) -> None:
        """Raise unless the parameter is in one of ``expected`` (``doing``: what needs it, for the message)."""
        if self.state not in expected:
            wanted = " or ".join(s.value for s in expected)
            raise RuntimeError(
                f"flatshard: whole-tensor parameter {self.name!r} (shape {tuple(self.shape)}, owner rank "
                f"{self.owner} of its shard group) is {self.state.value} on rank {self.rank}, but {doing} needs it "
                f"{wanted}. HINT: call the optimizer's step() and save or load its state only between steps, never "
                "inside another step of the same optimizer (a closure that steps or saves it again)."
            )

    def move_to(self, state: WholeState, doing: str) -> None:
        """The one way a parameter changes state: checks that ``state`` may follow the current one, and that only
        the owner holds the parameter whole."""
        self.check_state(*(s for s, nxt in _NEXT.items() if state in nxt), doing=doing)
        if (state is WholeState.WHOLE_ON_OWNER) != self.owned and state is not WholeState.PIECE:
            raise RuntimeError(
                f"flatshard: whole-tensor parameter {self.name!r} would be {state.value} on rank {self.rank}, its "
                f"owner is rank {self.owner}. HINT: this is a bug in flatshard; please report it."
            )
        self.state = state


@dataclass(eq=False)
class WholeGroup:
    """The parameters of one shard group (and device and dtype): they travel in one all-to-all."""

    group: Any
    world: int
    rank: int
    device: torch.device
    dtype: torch.dtype
    params: list[WholeParam] = field(default_factory=list)
    # of describe(): equal on every rank that planned alike (see whole_exchange.agree_on_step)
    digest: int = 0

    def describe(self) -> list[tuple[str, tuple[int, ...], int, tuple[int, ...]]]:
        """Each parameter's name, shape, owner and elements on each rank, in order: what the group's all-to-alls
        are computed from, so what every rank of the group must agree on."""
        return [(q.name, tuple(q.shape), q.owner, tuple(q.counts)) for q in self.params]


@dataclass(eq=False)
class WholeTensorPlan:
    """One optimizer's sharded parameters by shard group, with their owners; kept on the optimizer."""

    key: tuple[tuple[int, int], ...]  # the ids of the optimizer's parameters and of their units when planned
    groups: list[WholeGroup]
    optimizer_name: str = "the optimizer"  # its class, for messages
    # elements this rank sent in the exchanges of the last step: values and gradients to owners, pieces back
    sent: dict[str, int] = field(default_factory=lambda: {"values": 0, "grads": 0, "back": 0})
    # engine/state/whole_state.py: (id(parameter), key) of state tensors that are whole (not shaped like their
    # parameter), while a save reads the state, and from a load until after_load
    saving_whole: set[tuple[int, str]] = field(default_factory=set)
    loaded_whole: set[tuple[int, str]] = field(default_factory=set)

    def params(self) -> Iterator[WholeParam]:
        for g in self.groups:
            yield from g.params

    def in_step(self) -> bool:
        """Whether some parameter is not a piece: inside the step, or after a step that raised."""
        return any(q.state is not WholeState.PIECE for q in self.params())

    def recover(self) -> None:
        """Pieces back in place after a step that raised (its post-step hook never ran): the shards are unchanged,
        the owners' whole values are not to be trusted, so the next step sends values again."""
        if not self.in_step():
            return
        for q in self.params():
            if q.state is not WholeState.PIECE:
                q.param.data = q.piece()
                q.param.grad = q.grad_piece
                q.grad_piece = None
                q.move_to(WholeState.PIECE, "putting the pieces back after a step that raised")
            q.whole = None


def cost(shape: torch.Size) -> int:
    """An optimizer's work on a tensor of ``shape``: elements times the smaller side for a matrix (Newton-Schulz),
    elements otherwise."""
    numel = int(shape.numel())
    return numel * min(shape[-2:]) if len(shape) >= 2 else numel


def assign_owners(shapes: list[torch.Size], world: int) -> list[int]:
    """The owner of each tensor: by decreasing cost, each to the least loaded rank (ties: the lowest rank)."""
    owners = [-1] * len(shapes)
    load = [0] * world
    for i in sorted(range(len(shapes)), key=lambda i: -cost(shapes[i])):
        owner = min(range(world), key=lambda r: (load[r], r))
        owners[i] = owner
        load[owner] += cost(shapes[i])
    return owners


_MASK = (1 << 62) - 1  # digests and their negatives fit an int64


def digest(value: object) -> int:
    """A 62-bit digest of ``repr(value)``, the same on every rank for equal values (not Python's ``hash``, which
    is randomised per process for strings)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") & _MASK


def existing_plan(optimizer: torch.optim.Optimizer) -> WholeTensorPlan | None:
    """The plan kept on ``optimizer``, if one was made (no planning)."""
    plan = getattr(optimizer, _ATTR, None)
    return plan if isinstance(plan, WholeTensorPlan) else None


def plan_for(optimizer: torch.optim.Optimizer) -> WholeTensorPlan:
    """The optimizer's plan, made again when its parameters or their units changed (a plan made before
    ``shard()``, when nothing was sharded, is not kept after it). No communication: every rank plans alike."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    key = tuple((id(p), id(handle_of_param(p))) for p in params)
    cached = existing_plan(optimizer)
    if cached is not None and cached.key == key:
        return cached
    if cached is not None:
        cached.recover()
    groups: dict[tuple[int, torch.device, torch.dtype], WholeGroup] = {}
    for p in params:
        handle = handle_of_param(p)
        if handle is not None and handle.tensor_parallel is not None:
            raise ValueError(
                f"{type(optimizer).__name__} needs each parameter whole, and in a tensor parallel model a rank holds "
                "a tensor-parallel piece of it (see [Note: tensor parallelism]). HINT: use an elementwise optimizer "
                "(AdamW, SGD) with tensor_parallel_size, or train without tensor parallelism."
            )
        if handle is None or handle.shard_world == 1:  # not sharded: whole already
            continue
        i = handle.index_of(p)
        where = (id(handle.shard_group), handle.device, handle.dtype)
        g = groups.get(where)
        if g is None:
            g = groups[where] = WholeGroup(
                handle.shard_group, handle.shard_world, handle.shard_rank, handle.device, handle.dtype
            )
        infos = [handle.layout.shard_infos(r)[i] for r in range(handle.shard_world)]
        g.params.append(
            WholeParam(
                p,
                handle,
                i,
                handle.names[i],
                -1,
                g.rank,
                handle.layout.shapes[i],
                [x.numel_in_shard for x in infos],
                [x.offset_in_param for x in infos],
            )
        )
    for g in groups.values():
        for q, owner in zip(g.params, assign_owners([q.shape for q in g.params], g.world), strict=True):
            q.owner = owner
        g.digest = digest((g.world, g.describe()))
    plan = WholeTensorPlan(key, list(groups.values()), type(optimizer).__name__)
    if cached is not None:  # a load in progress keeps its record (see whole_state.note_loaded_whole)
        plan.loaded_whole = cached.loaded_whole
    setattr(optimizer, _ATTR, plan)
    return plan
