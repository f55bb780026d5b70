"""Forward / backward hooks, root lazy init, and the end-of-backward callback.

[Note: unit lifecycle in one iteration]
1. Pre-forward of a unit: the root (the first unit whose forward runs) lazily collects every unit
   below it once. The unit gathers its flat parameter and puts unsharded views on its modules.
2. Post-forward: hooks are put on the outputs that require grad (they mark the start of the unit's
   backward). Non-root units reshard now under FULL_SHARD; under SHARD_GRAD_OP they stay gathered until
   their backward ends. The root stays gathered when a backward will follow (its parameters are needed
   first thing), unless ``reshard_root_after_forward`` (then it is gathered again in step 3), and reshards
   at once under ``no_grad`` / ``inference_mode``.
3. Pre-backward (a hook on the unit's outputs fired): gather again if the unit was resharded; the first
   one of a backward pass queues the end-of-backward callback.
4. Post-backward (the unit's gradients are complete; see [Note: gradients of a unit]): finish the
   previous unit's reduction, start this one's asynchronously and reshard, once the unit's backward is
   done (see [Note: when a unit with frozen parameters is done]).
5. End of backward: wait for every reduction (with CPU offload the CPU waits once for the copies to host
   memory), accumulate into the gradient shards, reshard whatever is still gathered, reset per-iteration
   state.

[Note: when a unit with frozen parameters is done]
A unit whose parameters all train is done with its gathered parameters when its gradient node runs: every
operation that reads them computes a gradient of one of them. Frozen parameters are not inputs of that node,
and operations that read only them (``base(x)`` of a LoRA layer) may run later in backward, to compute the
gradient of the unit's inputs for the units before it. So such a unit also waits for the gradients of its
forward inputs (a hook on the inputs that require grad, per forward call): it reshards when its gradient
node has run (or it has no trainable parameter) and every input gradient is computed, and at the end of
backward at the latest. Inputs that need no gradient (the first block of a frozen model) are not waited for:
autograd never runs an operation whose result reaches no tensor that requires grad. As in torch FSDP2, an
operation that reads the unit's frozen parameters to compute the gradient of a tensor that is neither an
input nor a parameter of the unit (a tensor captured from outside, not passed as an argument) is not waited
for. Without this, every unit of a fine-tuned model stayed gathered until the end of backward: the whole
model unsharded at once.

[Note: backward inside a forward]
Lightning runs ``training_step`` as the root's forward, and manual optimization calls ``backward`` (and
``optimizer.step``) inside it, possibly more than once, with more forwards in between (two optimizers, a
GAN). The root's outputs carry no backward hook yet, so the strategy starts the root's backward at the loss
(:func:`begin_backward_in_forward`); that queues the end-of-backward callback as usual. A unit still inside its
forward is not resharded by its backward: at the end of backward it stays gathered and gets fresh autograd
views (``resume_forward``), so the rest of the forward uses it, and reshards when its forward returns. An
optimizer step in between changes the shards under it: the strategy then gathers it again
(:func:`regather_in_forward`), so a second forward in the same step sees the updated weights, as under DDP.
Such a step may also toggle ``requires_grad`` (``toggle_optimizer``) after the root's views were made, so
during it the root tracks every parameter (``ForwardCall.track_frozen``) and gradients go only to the
parameters that require grad when the backward ends: a frozen parameter held by the root costs a gradient
computation there.

[Note: forward inside unshard_params]
Inside ``flatshard.unshard_params`` every original Parameter's data is its full tensor and the modules hold
the Parameters themselves (see [Note: unshard_params]), so a forward needs nothing from the hooks: they let
it run as the plain module would, with no gather, no collective and no change to the execution order or the
training state. That is what generation, evaluation or export on a sharded model wants: on every rank, or
with ``rank0_only=True`` on rank 0 alone while the others hold only their shards (their forward is refused
with a hint, since they have nothing to compute with). A backward through such a forward is refused when it
reaches a unit's output: the full parameters are temporary buffers, and their gradients would reach no
shard.

[Note: calls routed through a root's forward]
A caller may run something other than a module forward through a root's hooks (Lightning runs
``training_step`` as the root's forward, so the root gathers around the step). How such a call behaves is
one :class:`ForwardCall` record set for its duration with :func:`forward_call`: whether its arguments are
cast like a unit's forward inputs (a step's batch keeps its dtypes under autocast) and whether the root
tracks every parameter. The engine knows nothing else of the caller; the Lightning side keeps its step
modes in one object (``flatshard.lightning.step_modes``).
"""

from __future__ import annotations

import enum
import functools
import logging
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten

from flatshard.engine.activation_offload import ActivationOffload
from flatshard.engine.config import BackwardPrefetch, ShardOptions
from flatshard.engine.exec_order import ExecOrder
from flatshard.engine.float8 import Float8Scales
from flatshard.engine.gradients import used_anywhere
from flatshard.engine.handle import FlatParamHandle, HandleState
from flatshard.engine.precision import cast_floating
from flatshard.engine.transport.interface import Transport
from flatshard.engine.transport.limiter import AllGatherLimiter
from flatshard.engine.transport.streams import CommContext
from flatshard.engine.unfilled import BufferMark, UnfilledError, unfilled_message

__all__ = [
    "ForwardCall",
    "RootContext",
    "Summoned",
    "TrainingState",
    "UnitState",
    "begin_backward_in_forward",
    "enclosing_units",
    "forward_call",
    "get_unit_state",
    "raise_if_unfilled",
    "regather_in_forward",
    "unit_states",
]

log = logging.getLogger(__name__)

STATE_ATTR = "_flatshard_state"
# On every module under a shard() call: the UnitState of the outermost module shard() was called on above it
# (see enclosing_units); kept by the module itself, so it goes with the model.
ROOT_ATTR = "_flatshard_root"

# Gradient reductions in flight while a unit's backward runs: one overlaps the next unit's backward and is finished
# before the next unit's gradient is taken, so one unsharded gradient is alive at a time (each more keeps another).
_MAX_PENDING_REDUCTIONS = 1


class Summoned(enum.Enum):
    """Whether a unit is inside ``flatshard.unshard_params``, and what this rank holds there."""

    NO = "no"  # not inside: forward gathers as usual
    FULL = "full"  # full parameters on the modules: forward runs on them, without hooks' work or collectives
    SHARDS_ONLY = "shards_only"  # rank0_only on another rank: this rank keeps its pieces, forward is refused


class TrainingState(enum.Enum):
    IDLE = "idle"  # between iterations, or after the end-of-backward callback
    FORWARD = "forward"  # inside the unit's forward (hooks entered, not yet left)
    BACKWARD = "backward"  # the unit's pre-backward hook fired in the current backward pass


class RootContext:
    """Per-root data, created once on the root's first forward (lazy init) and cached.

    [Note: what a root owns]
    As torch FSDP2's comm context, it holds what the root's units share in a step: streams, the limiter, the
    execution order, the reductions in flight, and its units' transports (whose gathered blocks it returns at
    the end of a pass). Its units hold it and it holds them; with their module it goes. What belongs to a
    process group rather than a root is the group's (see [Note: state per process group]).
    """

    def __init__(self, root: UnitState, states: list[UnitState]) -> None:
        self.root = root
        self.states = states  # every unit under the root, root first, in .modules() order
        self.handles = [h for s in states for h in s.handles]
        # the transports of its units (one, unless nested shard() calls used other groups or devices)
        self.transports: list[Transport] = list({id(h.transport): h.transport for h in self.handles}.values())
        device = next((h.device for h in self.handles), torch.device("cpu"))
        self.streams = CommContext(device)
        # Two units' buffers in flight (see [Note: rate limiter]): a unit holding parameters of several dtypes
        # frees one buffer per dtype.
        per_unit = max((len(s.handles) for s in states), default=1)
        self.limiter = AllGatherLimiter(2 * per_unit, enabled=root.options.limit_all_gathers)
        self.order: ExecOrder[UnitState] = ExecOrder()
        self.pending: deque[tuple[FlatParamHandle, Any]] = deque()
        self.callback_queued = False
        self.step = 0  # training forwards of this root so far: names collectives in a desync report
        self.filled = False  # every unit's tensors have values: see [Note: unfilled tensors]
        self.activations = ActivationOffload(self)  # see [Note: activation offload]
        self.float8 = Float8Scales(self.handles)  # see [Note: float8 all-gathers]

    def unshard(self, state: UnitState | None) -> None:
        """Issue ``state``'s all-gather if it is sharded (used for its own gather and for prefetch)."""
        if state is None or not state.handles:
            return
        if self.root.join is not None and any(
            h.state is HandleState.SHARDED and h.shard_world > 1 for h in state.handles
        ):
            self.root.join.announce(self, state)  # see [Note: joining uneven evaluation loops]
        for handle in state.handles:
            handle.where = (state.path, "backward" if self.callback_queued else "forward", self.step)
            handle.unshard(self.streams, self.limiter, from_local=self.callback_queued)

    def prefetch_backward(self, state: UnitState | None) -> None:
        """Gather the unit whose backward comes next, unless its backward already began in this pass.

        The recorded order can name a unit that already ran: a root whose tied embedding is used first in
        forward completes its gradient last, after every block, and the order puts the last block after it.
        """
        if state is not None and state.training_state is not TrainingState.BACKWARD:
            self.unshard(state)

    def reshard_deferred(self) -> None:
        """Reshard the units a registered method call kept gathered (see [Note: methods other than forward])."""
        for state in self.states:
            if not state.deferred_reshard:
                continue
            state.deferred_reshard = False
            if state.forward_depth == 0:
                state.reshard()

    def finish_oldest_reduction(self) -> None:
        handle, inflight = self.pending.popleft()
        handle.finish_grad(inflight, self.streams)

    def end_of_backward(self) -> None:
        """Autograd's final callback: see step 5 of [Note: unit lifecycle in one iteration]."""
        while self.pending:
            self.finish_oldest_reduction()
        for handle in self.handles:
            grads = handle.take_view_grads()  # left by a node whose post-backward did not fire (defensive)
            leftover = handle.pack_grads(grads) if grads is not None else None
            if handle.keeps_unsharded:
                if leftover is not None:
                    handle.keep_unsynced(leftover)
                continue
            if handle.has_unsynced and not handle.grad_this_backward:
                leftover = handle.with_unsynced(leftover)  # kept by no_sync; unused in this backward
            if leftover is not None:
                handle.where = (handle.where[0] if handle.where else "?", "end of backward", self.step)
                handle.finish_grad(handle.reduce_grad(leftover, self.streams), self.streams)
            elif (
                handle.has_replica_partial
                and not handle.grad_this_backward
                and not handle.defers_replica_reduce
            ):
                handle.reduce_partial(self.streams)  # see [Note: replica reductions once per step]
        for handle in self.handles:  # writes into gradient shards come after their copies to the host
            if handle.host is not None:  # see [Note: host copies and the streams]
                handle.host.before_grad_write(self.streams)
        offloaded = [h for h in self.handles if h.has_host_grads]
        if offloaded:  # one wait for every copy to host memory: see [Note: CPU offload]
            self.streams.sync_host(self.streams.post_backward)
            for handle in offloaded:
                handle.accumulate_host_grads()
        reduced = [h for h in self.handles if h.grad_this_backward]
        for handle, used in zip(reduced, used_anywhere(reduced)):
            handle.assign_grads(used)
        for handle in self.handles:  # a unit whose backward did not run leaves its copy
            handle.drop_local()
        self.callback_queued = False
        self.activations.end_backward()
        for state in self.states:
            state.reset_backward_watch()
            if state.forward_depth > 0:  # see [Note: backward inside a forward]
                state.resume_forward()
                continue
            state.reshard()
            state.training_state = TrainingState.IDLE
        self.release_blocks()

    def release_blocks(self) -> None:
        """The pass is over: the transports return the gathered blocks they kept (see [Note: reusing freed
        blocks])."""
        for transport in self.transports:
            transport.release_blocks()


@dataclass(frozen=True)
class ForwardCall:
    """How a call routed through a unit's forward hooks runs; see [Note: calls routed through a root's forward].

    Args:
        cast_inputs: under mixed precision, cast the call's floating-point arguments to the compute dtype,
            as for any unit's forward. ``False`` for a call whose arguments are data (a training step's batch,
            targets and masks under autocast): they keep their dtypes. Default: ``True``.
        track_frozen: the call may toggle ``requires_grad`` after the unit's views were made (manual
            optimization's ``toggle_optimizer``): give every parameter an autograd view, so gradients reach
            whichever require grad when the backward ends (see [Note: backward inside a forward]).
            Default: ``False``.
        method: the call is a registered method, not the module's forward (see [Note: methods other than
            forward]): the forwards inside it are not recorded in the execution order and prefetch nothing.
            Default: ``False``.
        keep_gathered: with ``method``, units gathered by forwards inside the call stay gathered until it
            returns instead of resharding after each forward (a decode loop gathers each unit once).
            Default: ``False``.
    """

    cast_inputs: bool = True
    track_frozen: bool = False
    method: bool = False
    keep_gathered: bool = False


_PLAIN_FORWARD = ForwardCall()


class _OutsideGraphs:
    """A hook method that dynamo never traces: it runs eagerly, outside compiled graphs (see [Note:
    torch.compile] in ``flatshard.engine.calls.compile``). The method is wrapped in ``torch.compiler.disable`` when
    first looked up, so that importing flatshard does not import dynamo; it binds like a method, so copies and
    pickles of a unit call their own state."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self.method = method
        self.wrapped: Callable[..., Any] | None = None

    def __get__(self, state: object, owner: type | None = None) -> Callable[..., Any]:
        if self.wrapped is None:
            self.wrapped = torch.compiler.disable(self.method, reason="flatshard's hooks run outside graphs")
        return self.wrapped if state is None else MethodType(self.wrapped, state)


_HANDOFF_ATTR = "_flatshard_handoff"


class _AnchorHook:
    """A unit's post-backward hook on its handles' ``grad_anchor``, reaching the unit through a weak reference.

    torch keeps a tensor's post-accumulate-grad hooks where the garbage collector does not look, so a hook bound
    to the unit that owns the tensor made a cycle no collection frees: every sharded model stayed in memory after
    its last reference was dropped. The unit lives as long as its module (which holds it), so the weak reference
    finds it whenever its backward can run.
    """

    __slots__ = ("unit",)

    def __init__(self, unit: UnitState) -> None:
        self.unit = weakref.ref(unit)

    def __call__(self, anchor: torch.Tensor) -> None:
        unit = self.unit()
        if unit is not None:
            unit._post_backward(anchor)


class _InputWatch:
    """One forward call of a unit with frozen parameters, until backward has computed its inputs' gradients."""

    __slots__ = ("done", "unit")

    def __init__(self, unit: UnitState) -> None:
        self.unit = unit
        self.done = False

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        unit = self.unit
        unit._inputs_pending = max(0, unit._inputs_pending - 1)
        unit._reshard_if_backward_done()


class _Handoff:
    """The forward calls whose one input that requires grad is a given unit output.

    [Note: handing over]
    A unit with frozen parameters is done in backward when its inputs' gradients are computed (see [Note: when a
    unit with frozen parameters is done]). In a stack of blocks its input is the previous unit's output, and
    the hook that notices that gradient (``register_multi_grad_hook`` on the input) runs after the previous
    unit's own pre-backward hook on the same tensor, which gathers the unit after it (backward prefetch):
    without care, each block would be freed one gather late, and backward would hold one more unit gathered
    than forward. So each training output carries a hand-off, and a later forward call whose only input that
    requires grad is that output registers there: the output's pre-backward hook, which fires once that
    gradient is complete, finishes those calls first (freeing their units), then prefetches. The block just
    freed is the one the prefetch then reuses (see [Note: reusing freed blocks]). The multi-grad hook stays,
    for inputs that are not a unit's output, and does nothing for a call already finished.
    """

    __slots__ = ("watches",)

    def __init__(self) -> None:
        self.watches: list[_InputWatch] = []


class UnitState:
    """State of one unit (a module passed to or chosen by ``shard()``), stored on the module."""

    def __init__(self, module: nn.Module, handles: list[FlatParamHandle], options: ShardOptions) -> None:
        self.module = module
        # One flat parameter per dtype of the unit's parameters, usually one (see [Note: a unit of several
        # dtypes]); empty for a unit without parameters of its own.
        self.handles = handles
        self.options = options  # the normalised shard() options, for nested units and the strategies
        self.strategy = options.sharding_strategy
        self.training_state = TrainingState.IDLE
        self.forward_depth = 0
        self.summoned = (
            Summoned.NO
        )  # inside flatshard.unshard_params: see [Note: forward inside unshard_params]
        self.call = _PLAIN_FORWARD  # how the current call through this unit's hooks runs (forward_call)
        self.deferred_reshard = False  # kept gathered by a registered method call (ForwardCall.keep_gathered)
        # after a training forward (non-root): True frees, False keeps, k keeps a copy over node_group (set by
        # shard() and set_reshard_after_forward; see [Note: a node-local copy for backward])
        self.reshard_after_forward: bool | int = options.sharding_strategy.reshard_after_forward
        self.node_group: Any = None
        self.join: Any = None  # a root inside flatshard.join: its join.JoinState
        self.path = type(module).__name__  # the module's path under the module given to shard() (set there)
        self.recompute_inside = False  # a checkpointed module's parameters belong to this unit
        self._recomputing = False  # this forward is a recomputation inside backward
        self._tracked = False  # this forward is recorded in the execution order (a training forward)
        # see [Note: when a unit with frozen parameters is done]
        self._grads_done: set[int] = set()  # handles whose gradient node ran in this backward (their index)
        self._inputs_pending = 0  # forward calls whose input gradients backward has not computed yet
        self._input_hooks: list[Any] = []
        # buffers of a meta-built model nothing gave values (on the unit shard() was called on): see [Note:
        # unfilled tensors]; _refused: the pre-forward hook refused this call, the post-forward hook skips it
        self.unfilled_buffers: list[BufferMark] = []
        self._refused = False
        self.ctx: RootContext | None = None
        self._hook_handles: list[Any] = []
        self._register_hooks()

    @property
    def is_root(self) -> bool:
        return self.ctx is not None and self.ctx.root is self

    def _register_hooks(self) -> None:
        m = self.module
        self._hook_handles.append(
            m.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
        )
        self._hook_handles.append(m.register_forward_hook(self._post_forward, always_call=True))
        for handle in self.handles:  # also for frozen units: requires_grad may change while training
            self._hook_handles.append(
                handle.grad_anchor.register_post_accumulate_grad_hook(_AnchorHook(self))
            )

    @property
    def all_require_grad(self) -> bool:
        return all(h.all_require_grad for h in self.handles)

    def reshard(self, keep_local: Any = None) -> None:
        """Free the unit's gathered parameters (a no-op for those already sharded); ``keep_local``: see
        [Note: a node-local copy for backward]."""
        ctx = self.ctx
        for handle in self.handles:
            handle.reshard(ctx.streams if ctx else None, ctx.limiter if ctx else None, keep_local)

    def wait_and_use_views(self) -> None:
        """Wait for the unit's gathers and put views of the gathered parameters on its modules."""
        ctx = self.ctx
        for handle in self.handles:
            handle.wait_unshard(ctx.streams if ctx else None)
            handle.use_unsharded_views()

    def unfilled_names(self) -> list[str]:
        """Names of the unit's parameters and buffers nothing gave values yet (see [Note: unfilled tensors])."""
        self.unfilled_buffers = [b for b in self.unfilled_buffers if not b.filled()]
        return [n for h in self.handles for n in h.unfilled_names()] + [b.name for b in self.unfilled_buffers]

    def refresh_requires_grad(self, track_frozen: bool = False) -> None:
        for handle in self.handles:
            handle.refresh_requires_grad(track_frozen)

    # ------------------------------------------------------------------ lazy init
    def _lazy_init(self) -> None:
        states = [get_unit_state(m) for m in self.module.modules()]
        ordered = [s for s in states if s is not None]
        ctx = RootContext(self, ordered)
        for s in ordered:
            s.ctx = ctx

    # ------------------------------------------------------------------ forward
    @_OutsideGraphs
    def _pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        if self.summoned is not Summoned.NO:  # see [Note: forward inside unshard_params]
            self._check_summoned_forward()
            return args, kwargs
        if self.forward_depth == 0:
            ctx = self.ctx
            if ctx is None or (
                ctx.root is not self and ctx.root.forward_depth == 0 and not ctx.callback_queued
            ):
                # First forward, or a unit called on its own, outside its root's forward: it is a root now.
                self._lazy_init()
            elif ctx.root is self:
                for s in ctx.states:  # take back units that ran on their own in between (cheap)
                    s.ctx = ctx
            ctx = self.ctx
            assert ctx is not None
            if ctx.root is self and not ctx.filled:
                self._refused = True  # the post-forward hook runs even when this one raises
                raise_if_unfilled(ctx.states, f"{type(self.module).__name__}.forward was called")
                ctx.filled, self._refused = True, False
        self.forward_depth += 1
        if self.forward_depth > 1:
            return args, kwargs
        ctx = self.ctx
        assert ctx is not None
        # A forward re-run inside backward is an activation-checkpointing recomputation (see [Note:
        # activation checkpointing]): gather if needed, but leave the order and the state machine alone.
        in_backward = ctx.callback_queued
        self._recomputing = in_backward
        # Only a training forward (gradients on, not a registered method's) is recorded and checked against
        # the execution order: evaluation may call units in another order (see [Note: execution order]).
        tracked = not in_backward and not ctx.root.call.method and torch.is_grad_enabled()
        self._tracked = tracked
        if self.is_root:
            ctx.streams.refresh_compute()
            if tracked:
                ctx.order.begin_forward()
                ctx.step += 1
                for s in ctx.states:  # a forward without backward in between left nothing to wait for
                    s.reset_backward_watch()
                for h in ctx.handles:  # nor a node-local copy to gather from
                    h.drop_local()
            if ctx.float8 and not in_backward and self.join is None:  # see [Note: float8 all-gathers]
                ctx.float8.refresh(ctx.step)
        if tracked:
            ctx.order.note_pre_forward(self)
        ctx.activations.enter(self, tracked)
        if not in_backward:
            self.training_state = TrainingState.FORWARD
        if self.handles:
            if not in_backward:
                self.refresh_requires_grad(self.call.track_frozen)
            ctx.unshard(self)
            if self.options.forward_prefetch and tracked:
                ctx.unshard(ctx.order.next_forward(self))  # overlaps this unit's compute
            self.wait_and_use_views()
            # Inputs are cast as the unit's mixed-precision flat parameter says (a unit of several dtypes
            # has at most one compute dtype that differs from its parameters': the policy's param_dtype).
            precision = next((h.precision for h in self.handles if h.precision.mixed), None)
            cast = precision is not None and precision.cast_forward_inputs and self.call.cast_inputs
            if cast:  # see [Note: mixed precision]
                assert precision is not None
                args, kwargs = (
                    cast_floating(args, precision.compute),
                    cast_floating(kwargs, precision.compute),
                )
            if tracked and not self.all_require_grad:
                self._watch_inputs(args, kwargs)
        return args, kwargs

    def _watch_inputs(self, args: Any, kwargs: Any) -> None:
        """Count this forward call until backward has computed its inputs' gradients (see [Note: when a unit
        with frozen parameters is done])."""
        inputs = [
            t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if inputs:
            self._inputs_pending += 1
            watch = _InputWatch(self)
            self._input_hooks.append(
                torch.autograd.graph.register_multi_grad_hook(
                    inputs, functools.partial(self._inputs_done, watch), mode="all"
                )
            )
            handoff = getattr(inputs[0], _HANDOFF_ATTR, None) if len(inputs) == 1 else None
            if isinstance(handoff, _Handoff):  # the output of a unit before: see [Note: handing over]
                handoff.watches.append(watch)

    @_OutsideGraphs
    def _inputs_done(self, watch: _InputWatch, grads: Any) -> None:
        watch.finish()

    def _reshard_if_backward_done(self) -> None:
        if not self.handles or self.ctx is None or self.forward_depth > 0 or self._inputs_pending > 0:
            return
        if any(h.any_requires_grad and i not in self._grads_done for i, h in enumerate(self.handles)):
            return
        self.ctx.activations.unit_done(self)
        self.reshard()

    def reset_backward_watch(self) -> None:
        self._grads_done.clear()
        self._inputs_pending = 0
        for hook in self._input_hooks:
            hook.remove()
        self._input_hooks.clear()

    @_OutsideGraphs
    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self._refused:  # see _pre_forward: this call never started
            self._refused = False
            return output
        if self.summoned is not Summoned.NO:  # see [Note: forward inside unshard_params]
            if torch.is_grad_enabled():
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._refuse_backward)
            return output
        self.forward_depth -= 1
        if self.forward_depth > 0:
            return output
        ctx = self.ctx
        assert ctx is not None
        if self._recomputing:  # inside backward: stay gathered for the gradient computation that follows
            self._recomputing = False
            return output
        call = ctx.root.call
        if self._tracked:
            ctx.order.note_post_forward(self)
        ctx.activations.leave(self)
        self.training_state = TrainingState.IDLE
        grad_outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if torch.is_grad_enabled() and grad_outputs:
            for t in grad_outputs:
                if self._tracked:  # only training forwards watch their inputs: see [Note: handing over]
                    handoff = _Handoff()
                    setattr(t, _HANDOFF_ATTR, handoff)
                    t.register_hook(functools.partial(self._pre_backward, handoff=handoff))
                else:
                    t.register_hook(self._pre_backward)
            if self.is_root:  # its parameters are needed first thing in backward, unless told otherwise
                keep = not self.options.reshard_root_after_forward
            else:
                keep = self.reshard_after_forward is False
        else:
            keep = False
        if not keep and call.keep_gathered and not self.is_root and self.handles:
            self.deferred_reshard = keep = (
                True  # until the method returns: see [Note: methods other than forward]
            )
        if not keep:
            self.reshard(self.node_group if self._tracked and grad_outputs and not self.is_root else None)
            if not self.is_root and (not self._tracked or ctx.order.next_forward(self) is None):
                ctx.release_blocks()  # no gather follows in this forward
        if self.is_root and self._tracked:
            ctx.order.finish_forward()
        if self.is_root:
            ctx.release_blocks()  # the pass is over
        return output

    def _check_summoned_forward(self) -> None:
        if self.summoned is Summoned.SHARDS_ONLY:
            raise RuntimeError(
                f"{_rank_prefix()}{type(self.module).__name__}.forward was called inside "
                "flatshard.unshard_params(rank0_only=True) on a rank that holds only its shards. HINT: run the "
                "forward on rank 0 alone (if global_rank == 0: ...), or unshard on every rank (rank0_only=False)."
            )

    def _refuse_backward(self, grad: torch.Tensor) -> None:
        raise RuntimeError(
            f"{_rank_prefix()}backward through {type(self.module).__name__} was called on a forward run inside "
            "flatshard.unshard_params: the full parameters there are temporary, their gradients would reach no "
            "shard. HINT: leave the unshard_params context to train; inside it run forward under torch.no_grad()."
        )

    def resume_forward(self) -> None:
        """After a backward that ran inside this unit's forward: stay gathered, with fresh autograd views,
        for the rest of the forward (see [Note: backward inside a forward])."""
        self.training_state = TrainingState.FORWARD
        if self.handles and self.ctx is not None:
            self.refresh_requires_grad(self.call.track_frozen)
            with torch.enable_grad():
                self.wait_and_use_views()

    def refresh_in_forward(self) -> None:
        """Gather again every unit of this root that is inside its forward, after an optimizer step changed
        the shards (see [Note: backward inside a forward]); a collective, like any gather."""
        ctx = self.ctx
        if ctx is None or not self.is_root or self.forward_depth == 0:
            return
        for state in ctx.states:
            if not state.handles or state.forward_depth == 0:
                continue
            state.reshard()
            state.refresh_requires_grad(state.call.track_frozen)
            ctx.unshard(state)
            state.wait_and_use_views()

    def begin_backward_in_forward(self, tensor: torch.Tensor) -> None:
        """Call before ``tensor.backward()`` while this root's forward runs (see [Note: backward inside a
        forward]): its backward starts at ``tensor``, since the forward's outputs carry no hooks yet."""
        if self.is_root and self.forward_depth > 0 and tensor.requires_grad:
            tensor.register_hook(self._pre_backward)

    # ------------------------------------------------------------------ backward
    @_OutsideGraphs
    def _pre_backward(self, grad: torch.Tensor, handoff: _Handoff | None = None) -> None:
        ctx = self.ctx
        if ctx is None:
            return
        if handoff is not None:  # the units this output fed are done with it: see [Note: handing over]
            for watch in handoff.watches:
                watch.finish()
            handoff.watches.clear()
        if not ctx.callback_queued:
            ctx.callback_queued = True
            Variable._execution_engine.queue_callback(ctx.end_of_backward)
        first_time = self.training_state is not TrainingState.BACKWARD
        self.training_state = TrainingState.BACKWARD
        ctx.activations.before_backward(self, first_time)
        ctx.unshard(self)
        if first_time and self.options.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            ctx.prefetch_backward(ctx.order.next_backward(self))  # overlaps this unit's backward compute
        if self.recompute_inside:
            # Checkpointed submodules re-run their forward in this unit's backward without hooks of
            # their own: give them the gathered parameters, as autograd views like in forward.
            with torch.enable_grad():
                self.wait_and_use_views()
        else:
            for handle in self.handles:
                handle.wait_unshard(ctx.streams)

    @_OutsideGraphs
    def _post_backward(self, anchor: torch.Tensor) -> None:
        ctx = self.ctx
        index = next((i for i, h in enumerate(self.handles) if h.grad_anchor is anchor), None)
        if index is None or ctx is None:
            raise RuntimeError(
                f"{_rank_prefix()}post-backward hook fired on an uninitialised unit {self.module!r}."
            )
        handle = self.handles[index]
        grads = handle.take_view_grads()
        if grads is None:
            return
        # The reduction in flight had this unit's backward to finish in: wait for it now, before this
        # gradient is packed or sent, so the previous unit's unsharded gradient is freed first.
        while len(ctx.pending) >= _MAX_PENDING_REDUCTIONS:
            ctx.finish_oldest_reduction()
        self._grads_done.add(index)
        if handle.keeps_unsharded:  # see [Note: no_sync]
            handle.keep_unsynced(handle.pack_grads(grads))
            self._reshard_if_backward_done()
            return
        grad = handle.gradient_to_reduce(grads)
        handle.where = (self.path, "backward", ctx.step)
        ctx.pending.append((handle, handle.reduce_grad(grad, ctx.streams)))
        self._reshard_if_backward_done()
        if self.options.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            ctx.prefetch_backward(ctx.order.next_backward(self))


def raise_if_unfilled(states: list[UnitState], what: str) -> None:
    """Raise :class:`UnfilledError` naming every tensor of ``states`` nothing gave values yet."""
    names = [n for s in states for n in s.unfilled_names()]
    if names:
        raise UnfilledError(unfilled_message(names, what))


def enclosing_units(module: nn.Module) -> list[UnitState]:
    """The units whose module is ``module`` or contains it, outermost first (none for a module that no
    ``shard()`` call covered)."""
    top = module.__dict__.get(ROOT_ATTR)
    if not isinstance(top, UnitState):
        return []
    found = [(s, sum(1 for _ in s.module.modules())) for s in unit_states(top.module)]
    inside = [(s, n) for s, n in found if any(m is module for m in s.module.modules())]
    inside.sort(key=lambda pair: -pair[1])
    return [s for s, _ in inside]


def get_unit_state(module: nn.Module) -> UnitState | None:
    state = module.__dict__.get(STATE_ATTR)
    return state if isinstance(state, UnitState) else None


def unit_states(module: nn.Module) -> list[UnitState]:
    """Every unit at or below ``module``, in ``.modules()`` order."""
    return [s for m in module.modules() for s in [get_unit_state(m)] if s is not None]


@contextmanager
def forward_call(module: nn.Module, call: ForwardCall) -> Iterator[None]:
    """Calls through ``module``'s forward hooks inside run as ``call`` says (see [Note: calls routed through a
    root's forward]); a module that is not a unit is left alone."""
    state = get_unit_state(module)
    if state is None:
        yield
        return
    previous, state.call = state.call, call
    try:
        yield
    finally:
        state.call = previous


def regather_in_forward(module: nn.Module) -> None:
    """After an optimizer step taken inside ``module``'s forward: gather again every unit still in its
    forward, so the rest of the forward sees the new weights (see [Note: backward inside a forward]). A
    collective: call it on every rank. Does nothing outside the root's forward."""
    state = get_unit_state(module)
    if state is not None:
        state.refresh_in_forward()


def begin_backward_in_forward(module: nn.Module, tensor: torch.Tensor) -> None:
    """Call before ``tensor.backward()`` while ``module``'s (a root's) forward runs: its backward starts at
    ``tensor``, since the forward's outputs carry no hooks yet (see [Note: backward inside a forward])."""
    state = get_unit_state(module)
    if state is not None:
        state.begin_backward_in_forward(tensor)


def _rank_prefix() -> str:
    if dist.is_available() and dist.is_initialized():
        return f"[rank {dist.get_rank()}] "
    return ""
