"""Optimizers that need each parameter whole (Muon, Adafactor, Shampoo-like) on sharded parameters.

[Note: whole-tensor optimizers]
Between steps a sharded parameter is a 1-D piece of its unit's shard, and so is its gradient. An elementwise
optimizer (SGD, AdamW) updates each piece on its own, and the pieces together are the unsharded update. An
optimizer that looks at a matrix as a whole (Muon orthogonalises the momentum by Newton-Schulz iterations,
Adafactor keeps row and column statistics, Shampoo-style preconditioners multiply by the matrix) cannot: torch's
Muon refuses a 1-D gradient, Adafactor would silently treat the piece as a vector.

So around ``step()`` of such an optimizer each of its sharded parameters is made whole on exactly one rank of its
shard group, its owner, and the optimizer runs there on the whole tensor, unchanged:

1. Owners are chosen once per optimizer (and again if its parameters change), the same on every rank: parameters
   by decreasing cost (elements times the smaller side for a matrix, the Newton-Schulz work; elements otherwise)
   each go to the rank with the least cost so far, so owners share the work and the optimizer state. The plan
   (``whole_plan.WholeTensorPlan``) is kept on the optimizer and goes with it.
2. When the gradients are final (after the closure, if ``step`` was given one; otherwise at once), the ranks of
   each shard group first check, in one small all-reduce, that they agree on the parameters and on which of them
   have a gradient (see [Note: the ranks agree before an all-to-all] in ``whole_exchange``); a rank that
   disagrees makes every rank raise, naming the ranks and the parameters, instead of a hang or garbage. Then one
   all-to-all over the shard group sends each rank's pieces of every such gradient to the parameter's owner.
   The owner keeps the whole value its last step left (see 4.), so values travel only when that copy is
   missing or stale. The owner sets the parameter's ``.data`` and ``.grad`` to the whole tensors; every other
   rank sets the gradient to ``None`` for the step, so the optimizer skips the parameter there (and keeps no
   state for it).
3. After the step, a second all-to-all sends each rank its piece of every updated parameter, copied into the
   shard; ``.data`` and ``.grad`` are the pieces again. The owner keeps the whole updated tensor.
4. Stale copies: anything may write a piece between steps, on every rank or on one only. After each step every
   rank notes each of its pieces' version mark (``WholeParam.version_mark``: the shard's version counter, shared
   by every view of the shard, and the parameter's own), and before the next step compares; the check of 2.
   carries whether any rank saw a change, and only then one more all-reduce of one flag per parameter (MAX over
   the group) makes every rank agree which parameters need values sent with their gradients. A step that raised
   drops the owners' copies.

   Seen, each with a test (``test_every_writer_of_pieces_makes_the_owners_take_new_values``, and
   ``..._see_in_place_edits_of_a_piece`` for one rank's edit): every write torch counts as in place, through the
   parameter (``with torch.no_grad(): p.mul_(0.9)``, ``module.load_state_dict``) or through the shard or a view
   or ``.detach()`` of it (``set_state_dict``, full or sharded; ``load_checkpoint`` of a file or a directory;
   ``unshard_params`` with writeback, also ``rank0_only``; ``EMA.swap``); and a write torch cannot see whose
   writer says so with ``torch.autograd.graph.increment_version``, as torch asks of such writers
   (``load_pretrained`` reads files into the shards by pointer and does). Reads (saves, ``get_state_dict``,
   ``unshard_params`` without writeback, forward) move no counter, so nothing is resent after them.
   Not seen: a write through ``p.data`` (or ``.numpy()``, or a pointer) with no ``increment_version`` after it:
   ``.data`` is a tensor with a version counter of its own. The owner then steps from its copy, as if the edit
   had not happened, and writes the result over the edited piece: the edit is lost, the ranks still agree.

   Why counters and not hashing: this module hashed each piece's bytes too, twice per step, which saw ``.data``
   writes as well. Measured on the ``cpu-small`` GPT (Muon on its 32 block matrices, 12.6M elements of pieces per
   rank, 2 ranks, one thread each; ``torch.optim.Muon``, AdamW on the rest): CRC-32 took 17.4 ms per pass over a
   rank's pieces on an idle core (2.9 GB/s), 35 ms per step; inside training, with both ranks on a loaded 2-core
   machine where a step took 3.1 to 11 s, 50 to 170 ms per step; the device digest (a positional sum) 64 ms per
   pass over the same pieces on the CPU. The version marks take 21 us per step, and the check of 2. (which
   replaced the old flag all-reduce) 0.4 to 3.4 ms there, mostly waiting for the other rank. Hashing cost a
   share of every step that grows with the parameters, for the one kind of write that torch itself leaves
   unmarked and that ``increment_version`` marks.

Each parameter's :class:`~flatshard.engine.step.whole_plan.WholeState` says where it stands: ``PIECE`` between
steps, ``WHOLE_ON_OWNER`` on its owner and ``SKIPPED_ON_NON_OWNER`` elsewhere from 2. to 3. Every change goes
through ``WholeParam.move_to``, which refuses a transition that does not follow (an error naming the parameter,
its state and the rank). A step that raised leaves parameters whole: the next step, save or load puts the
pieces back first (``WholeTensorPlan.recover``).

The optimizer state of such a parameter is therefore whole, on its owner only: the memory of sharding is kept,
divided by ownership rather than by elements; the owner's copy of the value adds as much again (about the
shard's own size for those parameters). Per step each rank sends its pieces' gradients to their owners and
the owners send the updated pieces back: ``2 P (N-1) / N**2`` elements per rank for ``P`` elements of such
parameters on ``N`` ranks, ``2/N`` of one reduce-scatter of them (``P (N-1) / N``): at most one extra
gradient-sized collective at 2 ranks, less beyond. Values add ``P (N-1) / N**2`` on the first step and
after an edit (of the edited parameters only). Measured on the ``cpu-small`` GPT's block matrices (25.2M
elements, ``last_exchange``): per rank and step 0.667x one reduce-scatter of them on 2 ranks (1.001x on the
first step, values included), 0.472x on 4 ranks (the busiest rank 0.611x): a piece owned by the rank holding
it does not travel. Before the owners kept values, every step sent them too. Hybrid sharding runs the same
owners in every replica group. NO_SHARD (one rank per shard group) holds parameters whole already: nothing
happens.

Why owners rather than every rank updating every parameter redundantly (each all-gathering every gradient and
value and running the optimizer on all of them), measured on the ``cpu-small`` GPT's 32 block matrices (25.2M
elements, 2 ranks, one thread each): Muon's step on all of them takes 0.702 s, on each owner's share 0.365 and
0.338 s, so owners halve the Newton-Schulz work that the redundant scheme repeats on every rank; each rank
sends ``2P(N-1)/N**2`` elements per step here (gradients to owners, pieces back) against ``2P(N-1)/N`` for
the redundant all-gather of values and gradients, which does not shrink as ranks are added; and the optimizer
state is divided by ownership instead of whole on every rank (Muon's momentum: 96 MiB per rank redundant, 48
owned here). End to end, Muon under flatshard took 0.94x DDP's step time (DDP runs all of it on every rank).

The built-in optimizers that need whole tensors are recognised by class (``torch.optim.Muon``,
``torch.optim.Adafactor``); any other class is declared with :func:`register_whole_tensor_optimizer` (or the
``whole_tensor_optimizers`` argument of ``shard()`` and the strategies, which registers them). The hooks are
torch's global optimizer step hooks, so the Trainer, Fabric and plain loops all take this path without a call
of their own; the declared classes and the hooks' handles are this module's only process-wide state
(``_REGISTRY``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from flatshard.engine.handle import handle_of_param
from flatshard.engine.step.optimizer_offload import (
    offloaded_post_step,
    offloaded_pre_step,
    refuse_whole_tensor_offload,
)
from flatshard.engine.step.whole_exchange import Entry, agree_on_step, from_owners, to_owners
from flatshard.engine.step.whole_plan import (
    WholeGroup,
    WholeParam,
    WholeState,
    WholeTensorPlan,
    existing_plan,
    plan_for,
)

__all__ = [
    "explaining_step_errors",
    "install_hooks",
    "is_whole_tensor_optimizer",
    "last_exchange",
    "register_whole_tensor_optimizer",
    "whole_tensor_classes",
]

log = logging.getLogger("flatshard")

_BUILTIN = tuple(
    c for c in (getattr(torch.optim, "Muon", None), getattr(torch.optim, "Adafactor", None)) if c
)


class _Registry:
    """The optimizer classes declared to need whole tensors, and torch's global optimizer step hooks that handle
    them (installed once: the handles say so)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._classes: list[type] = []
        self._hooks: tuple[RemovableHandle, RemovableHandle] | None = None

    def classes(self) -> tuple[type, ...]:
        return _BUILTIN + tuple(self._classes)

    def add(self, cls: type) -> None:
        with self._lock:
            if cls not in self._classes:
                self._classes.append(cls)

    def install_hooks(self) -> None:
        with self._lock:
            if self._hooks is None:
                self._hooks = (
                    register_optimizer_step_pre_hook(_pre_step),
                    register_optimizer_step_post_hook(_post_step),
                )


# The one piece of process-wide state here, and why: a class is declared once for the whole process (a decorator
# runs at import), about no model or optimizer in particular, and the hooks it needs are torch's process-wide
# optimizer step hooks. Everything per optimizer lives on the optimizer (whole_plan.WholeTensorPlan).
_REGISTRY = _Registry()


def whole_tensor_classes() -> tuple[type, ...]:
    """The optimizer classes handled as needing whole tensors: torch's and the registered ones."""
    return _REGISTRY.classes()


def register_whole_tensor_optimizer(cls: type) -> type:
    """Declare that ``cls`` (an optimizer class) needs each parameter whole; see [Note: whole-tensor optimizers].

    Usable as a class decorator. Subclasses are covered too.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(
            f"register_whole_tensor_optimizer takes an optimizer class (a torch.optim.Optimizer subclass), got "
            f"{cls!r}."
        )
    _REGISTRY.add(cls)
    _REGISTRY.install_hooks()
    return cls


def is_whole_tensor_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, whole_tensor_classes())


def install_hooks() -> None:
    """Register the global optimizer step hooks once per process (``shard()`` does). They also run the offloaded
    step of ``cpu_offload="optimizer"`` (see [Note: optimizer offload]) for every other optimizer."""
    _REGISTRY.install_hooks()


def _stale_here(live: list[WholeParam]) -> list[bool]:
    """Which of ``live`` this rank needs values sent for (see 4. of [Note: whole-tensor optimizers]): those with no
    whole value on the owner yet, or whose piece here was written since the last step (its version mark moved).
    The ranks combine their answers in :func:`agree_on_step`."""
    return [q.mark is None or (q.owned and q.whole is None) or q.mark != q.version_mark() for q in live]


def _gather_to_owners(plan: WholeTensorPlan) -> None:
    """Step 2 of [Note: whole-tensor optimizers]: gradients (and values where stale) to the owners, whole tensors
    put in place. On an error every parameter is a piece again."""
    plan.sent = {"values": 0, "grads": 0, "back": 0}
    try:
        for g in plan.groups:
            _gather_group(plan, g)
    except BaseException:
        plan.recover()
        raise


def _gather_group(plan: WholeTensorPlan, g: WholeGroup) -> None:
    at_live = [n for n, q in enumerate(g.params) if q.param.grad is not None]
    live = [g.params[n] for n in at_live]
    for q in live:
        q.check_state(WholeState.PIECE, doing="the exchange of gradients to their owners")
    # see [Note: the ranks agree before an all-to-all]
    stale = agree_on_step(g, at_live, _stale_here(live), f"{plan.optimizer_name}.step()")
    entries: list[Entry] = []
    for q, needs_value in zip(live, stale, strict=True):
        elsewhere = q.counts[g.rank] if not q.owned else 0
        if needs_value:
            entries.append((q, q.piece().detach().reshape(-1)))
            plan.sent["values"] += elsewhere
        entries.append((q, q.param.grad.detach().reshape(-1) if q.param.grad is not None else None))
        plan.sent["grads"] += elsewhere
    wholes = to_owners(g, entries, g.dtype, "gradients to their owners (whole-tensor optimizer step)")
    at = 0
    for q, needs_value in zip(live, stale, strict=True):
        value_at, grad_at = (at, at + 1) if needs_value else (None, at)
        at = grad_at + 1
        q.grad_piece = q.param.grad
        if not q.owned:
            q.move_to(WholeState.SKIPPED_ON_NON_OWNER, "the step's exchange to the owners")
            q.param.grad = None
            continue
        if value_at is not None:
            q.whole = wholes[value_at].view(q.shape).to(q.param.device)
        if q.whole is None:  # the flags said the owner's copy was current: it cannot be missing
            raise RuntimeError(
                f"flatshard: the owner (rank {g.rank}) of whole-tensor parameter {q.name!r} holds no whole value "
                "and none was sent. HINT: this is a bug in flatshard; please report it."
            )
        q.move_to(WholeState.WHOLE_ON_OWNER, "the step's exchange to the owners")
        q.param.data = q.whole
        q.param.grad = wholes[grad_at].view(q.shape).to(q.param.device, q.param.dtype)


def _scatter_from_owners(plan: WholeTensorPlan) -> None:
    """Step 3 of [Note: whole-tensor optimizers]: each rank's pieces of the updated parameters back to it."""
    for g in plan.groups:
        stepped = [q for q in g.params if q.state is not WholeState.PIECE]
        for q in stepped:
            q.check_state(
                WholeState.WHOLE_ON_OWNER if q.owned else WholeState.SKIPPED_ON_NON_OWNER,
                doing="the exchange of updated pieces back from their owners",
            )
        entries: list[Entry] = [(q, q.param.detach().reshape(-1) if q.owned else None) for q in stepped]
        plan.sent["back"] += sum(
            q.counts[d] for q in stepped if q.owned for d in range(g.world) if d != g.rank
        )
        for k, piece in from_owners(
            g, entries, g.dtype, "updated pieces from their owners (whole-tensor optimizer step)"
        ).items():
            stepped[k].piece().detach().reshape(-1).copy_(piece)
        for q in stepped:
            q.param.data = q.piece()
            q.param.grad, q.grad_piece = q.grad_piece, None
            q.move_to(WholeState.PIECE, "the exchange of updated pieces back from their owners")
        for q in stepped:
            q.mark = q.version_mark()


def _pre_step(optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if not is_whole_tensor_optimizer(optimizer):  # see [Note: optimizer offload]: these hooks' other user
        return offloaded_pre_step(optimizer, args, kwargs)
    refuse_whole_tensor_offload(optimizer)
    plan = plan_for(optimizer)
    if not plan.groups:
        return None
    plan.recover()  # the last step raised between the two exchanges
    # torch passes the step's own arguments: ``args[0]`` is the optimizer, ``args[1]`` a positional closure
    closure: Callable[[], Any] | None = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None:
        _gather_to_owners(plan)
        return None

    def gathered_after(closure: Callable[[], Any] = closure) -> Any:  # the gradients are final only after it
        loss = closure()
        _gather_to_owners(plan)
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": gathered_after}
    return (args[0], gathered_after, *args[2:]), kwargs


def _post_step(optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    plan = existing_plan(optimizer)
    if plan is not None and plan.in_step():
        _scatter_from_owners(plan)
    offloaded_post_step(optimizer)


@contextmanager
def explaining_step_errors(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """An error raised inside ``optimizer.step()`` by an optimizer not handled as needing whole tensors, which
    stepped 1-D pieces of sharded matrices, gets a note saying so and how to declare it (the strategies' steps
    run inside this; see [Note: whole-tensor optimizers])."""
    try:
        yield
    except Exception as err:
        note = _pieces_note(optimizer)
        if note is not None:
            if hasattr(err, "add_note"):  # Python 3.11 and newer: printed with the traceback
                err.add_note(note)
            else:
                log.error(note)
        raise


def _pieces_note(optimizer: torch.optim.Optimizer) -> str | None:
    if is_whole_tensor_optimizer(optimizer):
        return None
    for group in optimizer.param_groups:
        for p in group["params"]:
            handle = handle_of_param(p)
            if handle is None or handle.shard_world == 1:
                continue
            shape = handle.layout.shapes[handle.index_of(p)]
            if len(shape) < 2:
                continue
            cls = type(optimizer)
            return (
                f"flatshard: {cls.__name__}.step() got 1-D pieces of sharded parameters (one of shape "
                f"{tuple(shape)} is {p.numel()} elements here). HINT: if {cls.__name__} needs each parameter "
                f"whole (a matrix optimizer: Shampoo, SOAP, Dion...), declare it: "
                f'whole_tensor_optimizers=["{cls.__module__}.{cls.__qualname__}"] on the strategy or shard(), '
                f"or flatshard.register_whole_tensor_optimizer({cls.__name__})."
            )
    return None


def last_exchange(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Elements this rank sent in the last step's exchanges of ``optimizer`` (zeros if it has none): ``values``
    and ``grads`` to the owners, ``back`` the updated pieces to the ranks holding them."""
    plan = existing_plan(optimizer)
    return dict(plan.sent) if plan is not None else {"values": 0, "grads": 0, "back": 0}
