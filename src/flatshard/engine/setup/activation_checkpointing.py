"""Activation checkpointing inside units: recompute chosen submodules' activations in backward.

[Note: activation checkpointing]
A module selected by ``activation_checkpointing_policy`` runs its whole call (its forward hooks included)
under non-reentrant ``torch.utils.checkpoint``: forward keeps only the module's inputs, and backward
re-runs the call to rebuild what the gradient needs. Three things make that compose with sharding:

* **Nothing is renamed.** The call is wrapped on the instance (``_call_impl``), not by inserting a
  wrapper module, so parameter names, ``state_dict`` keys and checkpoints are the same with and without
  activation checkpointing and load either way.
* **Hooks run again in the recomputation.** A unit that is itself checkpointed sees its pre-forward hook
  inside backward: the unit is already gathered by its pre-backward hook, so the hook only points the
  modules at the gathered parameters, and the post-forward hook neither reshards nor registers backward
  hooks nor touches the recorded execution order (``UnitState`` checks ``RootContext.callback_queued``).
* **Submodules see full parameters.** A checkpointed submodule of a unit has no hooks of its own, so the
  unit's pre-backward hook points its modules at the gathered parameters (with autograd views, so that
  the recomputation saves the same tensors as the forward did, which the checkpoint checks).

Gradients still flow through the graph recorded in forward; the recomputation only supplies its saved
tensors. RNG state is restored for the recomputation, so dropout masks match.

[Note: selective checkpointing]
``activation_checkpointing_mode`` says what a checkpointed module keeps. ``"full"`` keeps nothing but its
inputs. ``"selective"`` and a list of operators run the same checkpoint with torch's
``create_selective_checkpoint_contexts`` as ``context_fn``: a dispatch mode sees every operator of the call,
keeps the outputs of the chosen ones in forward and hands them back in the recomputation instead of running
them again; every other operator is recomputed. So backward recomputes the cheap, memory-bound operators
(norms, activations, element-wise products, dropout) and none of the compute-bound ones.

* **What "selective" keeps** (:data:`SELECTIVE_OPS`): matrix products (``mm``, ``addmm``, ``bmm``,
  ``baddbmm``, float8 ``_scaled_mm``), every fused attention kernel (flash, memory-efficient, cuDNN, CPU
  flash), and functional collectives (tensor parallelism inside a unit), whose recomputation would
  communicate again. Every call is kept: unlike torchtitan's op-level policy, which recomputes every second
  ``mm`` to save more memory, the choice never depends on an operator's position in the module, so a module
  keeps the same tensors whatever order its layers run in, and a list of operators means exactly that list.
  Keeping every matrix product costs more memory than torchtitan's policy and recomputes less: for Llama 3.1 8B
  with two 8,192-token sequences per GPU the estimator (which runs this policy in its dry run) gives 58.6 GiB of
  activations against 39.6 GiB with every second ``mm`` recomputed (3 of a block's 7 matrix products run
  again), and 12.6 GiB with full checkpointing.
* **Only functional forms are kept.** An ``out=`` or in-place overload (compiled kernels call ``mm.out`` into
  buffers they reuse) is recomputed: handing back a kept tensor would leave the caller's buffer unwritten.
* **flatshard's own work is never kept.** A checkpointed unit's hooks run inside the checkpoint (see above):
  its all-gathers are process-group collectives, not functional ones, and its casts and views are cheap, so
  they are recomputed like any memory-bound operator and keeping a selective module's outputs never keeps a
  gathered parameter alive.
* **Random operators** are recomputed with the RNG state of the forward, as in full checkpointing.
* **The recomputation must replay the forward.** torch matches each kept output to the call of the same
  operator in the same order; a forward that changes state it reads (a Hugging Face key-value cache grown with
  ``use_cache=True``) runs other operators the second time, and torch's error is re-raised from backward naming
  the module, the likely cause and the fix (:class:`_ExplainMismatch`).
* **torch.compile**: see [Note: torch.compile], item 4.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from flatshard.engine.setup.wrap import resolve_policy

__all__ = [
    "SELECTIVE_OPS",
    "CheckpointMode",
    "apply_activation_checkpointing",
    "checkpointed_call",
    "is_checkpointed",
    "resolve_checkpointing_mode",
    "resolve_checkpointing_policy",
    "selective_contexts",
]

_MARK = "_flatshard_checkpointed"

CheckFn = Callable[[nn.Module], bool]

# ``activation_checkpointing_mode`` normalised: "full", "selective", or the names of the operators to keep.
CheckpointMode = str | tuple[str, ...]

# A checkpoint's ``context_fn``: the contexts its forward and its recomputation run in.
ContextFn = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]

_Packet = type(torch.ops.aten.mm)  # torch.ops' operator (every overload) and one overload of it
_Overload = type(torch.ops.aten.mm.default)

# The operators whose outputs ``activation_checkpointing_mode="selective"`` keeps: see [Note: selective
# checkpointing]. Names missing from this torch build are skipped.
SELECTIVE_OPS: tuple[str, ...] = (
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.baddbmm",
    "aten._scaled_mm",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_fused_attention_overrideable",
    "aten._flash_attention_forward",
    "aten._efficient_attention_forward",
    "_c10d_functional.all_reduce",
    "_c10d_functional.reduce_scatter_tensor",
    "_c10d_functional.all_gather_into_tensor",
    "_c10d_functional.all_to_all_single",
)

_MODES = ("full", "selective")
_MODE_HINT = (
    "use 'full' (recompute the whole module), 'selective' (keep matrix products and attention, recompute the "
    "rest) or a list of operators to keep, e.g. ['aten.mm', 'aten.addmm']"
)


def resolve_checkpointing_mode(value: object) -> CheckpointMode:
    """``activation_checkpointing_mode`` as ``"full"``, ``"selective"`` or a tuple of operator names.

    An operator is ``torch.ops``' packet or overload, or its name: ``"aten.mm"`` (every overload),
    ``"aten.mm.default"`` (one), ``"torch.ops.aten.mm"``, ``"aten::mm"``, or a bare ``"mm"`` for ``aten``'s.
    Names are checked against this torch build; an unknown one is a ``ValueError`` naming it.
    """
    if isinstance(value, str):
        key = value.strip().lower()
        if key in _MODES:
            return key
        raise ValueError(f"activation_checkpointing_mode={value!r} is not a mode. HINT: {_MODE_HINT}.")
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(
                "activation_checkpointing_mode=[] keeps no operator: that is full checkpointing. HINT: pass 'full', "
                "or name the operators to keep, e.g. ['aten.mm', 'aten.addmm']."
            )
        names: list[str] = []
        for item in value:
            op = _resolve_op(item)
            if isinstance(op, _Overload) and _writes_in_place(op):
                raise ValueError(
                    f"activation_checkpointing_mode lists {item!r}, an overload that writes into an argument: its "
                    "output is the caller's buffer, which a kept tensor cannot fill. HINT: name the operator "
                    f"({str(op.overloadpacket)!r}) or its functional overload."
                )
            name = str(op)
            if name not in names:
                names.append(name)
        return tuple(names)
    raise TypeError(
        f"activation_checkpointing_mode must be a string or a list of operator names, got "
        f"{type(value).__name__}: {value!r}. HINT: {_MODE_HINT}."
    )


def _resolve_op(item: object) -> Any:
    """An operator name (or ``torch.ops`` object) -> its ``OpOverloadPacket`` / ``OpOverload``."""
    if isinstance(item, (_Packet, _Overload)):
        return item
    if not isinstance(item, str):
        raise TypeError(
            f"activation_checkpointing_mode lists {item!r} ({type(item).__name__}), not an operator. HINT: name "
            "operators as strings such as 'aten.mm', or pass torch.ops.aten.mm."
        )
    name = item.strip().removeprefix("torch.ops.").replace("::", ".")
    parts = name.split(".") if "." in name else ["aten", name]
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(
            f"activation_checkpointing_mode lists {item!r}, which is not an operator name. HINT: write "
            "'namespace.operator' such as 'aten.mm', optionally with an overload: 'aten.mm.default'."
        )
    namespace = getattr(torch.ops, parts[0])
    try:
        op = getattr(namespace, parts[1])
        return getattr(op, parts[2]) if len(parts) == 3 else op
    except (AttributeError, RuntimeError):
        close = difflib.get_close_matches(parts[1], dir(namespace), n=3)
        known = f"did you mean {', '.join(f'{parts[0]}.{c}' for c in close)}? " if close else ""
        missing = ".".join(parts[1:])
        raise ValueError(
            f"activation_checkpointing_mode lists an unknown operator {item!r}: torch.ops.{parts[0]} has no "
            f"{missing!r} in torch {torch.__version__}. HINT: {known}operators are named as in torch.ops, e.g. "
            "'aten.mm', 'aten.addmm', 'aten._scaled_dot_product_flash_attention'."
        ) from None


class _KeepChosen:
    """Selective checkpointing's policy (torch's ``policy_fn``): keep the outputs of the chosen operators,
    recompute every other one (see [Note: selective checkpointing]).

    Only an operator's functional form is kept: an ``out=`` or in-place overload writes into a buffer its caller
    owns (compiled code calls ``mm.out`` into buffers it reuses), and handing back a kept tensor instead would
    leave that buffer unwritten, so those are recomputed.
    """

    def __init__(self, ops: list[Any]) -> None:
        self.packets = frozenset(op for op in ops if isinstance(op, _Packet))
        self.overloads = frozenset(op for op in ops if isinstance(op, _Overload))

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in self.overloads or (
            getattr(func, "overloadpacket", None) in self.packets and not _writes_in_place(func)
        ):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def __repr__(self) -> str:
        return f"keep {sorted(str(op) for op in self.packets | self.overloads)}"


def _writes_in_place(op: Any) -> bool:
    """Whether ``op`` (an overload) writes into an argument: ``mm.out``, ``add_.Tensor``."""
    overload = op.name().partition(".")[2]
    return bool(overload == "out" or overload.endswith("_out") or op.name().partition(".")[0].endswith("_"))


@functools.cache
def _policy(mode: CheckpointMode) -> _KeepChosen:
    """The policy for ``mode`` (operators looked up once per mode; a memo of constants)."""
    if mode == "selective":
        found = []
        for name in SELECTIVE_OPS:
            try:
                found.append(_resolve_op(name))
            except ValueError:
                continue  # not in this torch build
        return _KeepChosen(found)
    return _KeepChosen([_resolve_op(name) for name in mode])


def _selective_contexts(
    mode: CheckpointMode,
) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    return create_selective_checkpoint_contexts(_policy(mode))  # type: ignore[no-any-return]


def _explained_contexts(
    mode: CheckpointMode, where: str
) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    forward, recompute = _selective_contexts(mode)
    return forward, _ExplainMismatch(recompute, where)


class _ExplainMismatch(AbstractContextManager[Any]):
    """The recomputation's context: torch's, with its failure to replay the forward explained (the error comes
    out of autograd, which says nothing of the module or the likely cause)."""

    def __init__(self, inner: AbstractContextManager[Any], where: str) -> None:
        self.inner = inner
        self.where = where

    def __enter__(self) -> Any:
        return self.inner.__enter__()

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> Any:
        handled = self.inner.__exit__(kind, value, traceback)
        if isinstance(value, RuntimeError) and "not found in storage" in str(value):  # torch's replay failure
            rank = f"[rank {dist.get_rank()}] " if dist.is_available() and dist.is_initialized() else ""
            raise RuntimeError(
                f"{rank}selective activation checkpointing of {self.where}: its recomputation in backward ran other "
                f"operators than its forward did ({value}). A forward whose work depends on state it changes "
                "cannot be replayed: a Hugging Face model's key-value cache (use_cache=True) grows in forward, so the "
                "recomputation attends to more keys. HINT: train with use_cache=False (model.config.use_cache = "
                "False), or use activation_checkpointing_mode='full'."
            ) from value
        return handled


def selective_contexts(mode: CheckpointMode, where: str | None = None) -> ContextFn | None:
    """The ``context_fn`` of a checkpoint in ``mode``: ``None`` for ``"full"``, else torch's
    ``create_selective_checkpoint_contexts`` over the operators it keeps (``"selective"``: those of
    :data:`SELECTIVE_OPS` this torch has). A ``functools.partial`` of constants: it pickles, and dynamo traces it
    inside a compiled checkpoint. ``where`` (eager checkpoints only: dynamo takes torch's two modes alone): the
    module, named in the error raised when the recomputation cannot replay the forward."""
    if mode == "full":
        return None
    if where is None:
        return functools.partial(_selective_contexts, mode)
    return functools.partial(_explained_contexts, mode, where)


def resolve_checkpointing_policy(policy: Any) -> CheckFn | None:
    """``activation_checkpointing_policy`` as ``module -> bool``.

    Accepted: ``None``; module classes or their import paths (a set, list or tuple, or one class); an int
    (modules holding at least that many parameters, containers excluded); a callable ``module -> bool``;
    or a callable with torch FSDP's policy contract ``(module, recurse, nonwrapped_numel) -> bool``.
    """
    if policy is None:
        return None
    if callable(policy) and not isinstance(policy, type) and _arity(policy) == 1:
        return policy  # type: ignore[no-any-return]
    resolved = resolve_policy(policy, arg="activation_checkpointing_policy")
    return None if resolved is None else _PolicyCheck(resolved)


class _PolicyCheck:
    """A wrap-policy callable ``(module, recurse, nonwrapped_numel)`` asked about one module (picklable)."""

    def __init__(self, policy: Callable[[nn.Module, bool, int], bool]) -> None:
        self.policy = policy

    def __call__(self, module: nn.Module) -> bool:
        return bool(self.policy(module, False, sum(p.numel() for p in module.parameters())))

    def __repr__(self) -> str:
        return f"checkpoint if {self.policy!r}"


def _arity(fn: Callable[..., Any]) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return -1
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    return len(required) if len(required) == len(positional) else -1


class _CheckpointedCall:
    """The instance-level ``_call_impl`` of a checkpointed module (picklable with its module).

    ``compiled``: the module's compiled ``_call_impl`` (``torch.compile`` of it, as ``module.compile()`` makes),
    run inside the checkpoint instead of the plain one. Under ``torch.compile`` this frame itself is never
    traced: checkpointing runs eagerly around the compiled call (see [Note: torch.compile]). ``context_fn``:
    what a selective checkpoint keeps (see [Note: selective checkpointing]); ``None`` for full checkpointing.
    """

    def __init__(self, module: nn.Module, mode: CheckpointMode = "full") -> None:
        self.module = module
        self.compiled: Callable[..., Any] | None = None
        self.mode = mode
        self.context_fn = selective_contexts(mode, type(module).__name__)
        self.traced_context_fn = selective_contexts(mode)  # what dynamo traces: torch's two modes alone
        self.traced = False  # selective and compiled: the checkpoint is inside the compiled forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.traced:  # see [Note: torch.compile], item 4
            return self.compiled(*args, **kwargs)  # type: ignore[misc]
        call = self.compiled or type(self.module)._call_impl.__get__(self.module)
        if not torch.is_grad_enabled():  # nothing to save: no point recomputing
            return call(*args, **kwargs)
        context_fn = self.context_fn or noop_context_fn
        return checkpoint(call, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """The checkpointed module's ``compile`` (set on the module): the compiled call ``nn.Module.compile``
        makes, kept here to run inside the checkpoint, since ``nn.Module`` would call it directly. Selective,
        and with a forward of the class's own: the checkpoint moves inside the compiled forward instead, so that
        the compiler applies the policy (see [Note: torch.compile], item 4)."""
        module = self.module
        if self.context_fn is not None and "forward" not in module.__dict__:
            module.__dict__["forward"] = self.checkpointed_forward
            self.traced = True
        self.compiled = torch.compile(type(module)._call_impl.__get__(module), *args, **kwargs)

    def checkpointed_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The class's forward under a selective checkpoint: the compiled module's forward, traced by dynamo."""
        forward = type(self.module).forward
        if not torch.is_grad_enabled():
            return forward(self.module, *args, **kwargs)
        context_fn = self.traced_context_fn or noop_context_fn
        return checkpoint(forward, self.module, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


@functools.cache
def _skip_call_frames() -> None:
    """Dynamo skips :meth:`_CheckpointedCall.__call__`'s frame (still compiling what it calls). Registered when
    checkpointing is first applied, so importing flatshard does not import dynamo."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(_CheckpointedCall.__call__.__code__)


def is_checkpointed(module: nn.Module) -> bool:
    return bool(module.__dict__.get(_MARK, False))


def checkpointed_call(module: nn.Module) -> _CheckpointedCall | None:
    """The checkpointed call installed on ``module``, or ``None`` if it is not checkpointed."""
    call = module.__dict__.get("_call_impl") if is_checkpointed(module) else None
    return call if isinstance(call, _CheckpointedCall) else None


def apply_activation_checkpointing(
    root: nn.Module, check: CheckFn, skip: set[nn.Module], mode: CheckpointMode = "full"
) -> list[nn.Module]:
    """Checkpoint the outermost modules below ``root`` for which ``check`` is true, keeping what ``mode`` says
    (see [Note: selective checkpointing]).

    ``root`` itself never is, whatever ``check`` says (as with torch's ``apply_activation_checkpointing``): a
    size or FSDP-style policy matches it since it holds every parameter, and under Lightning its forward is
    the training step, which a recomputation must not run again. Modules in ``skip`` (ignored modules) are
    left alone, and nothing inside a checkpointed module is checkpointed again. Returns the checkpointed
    modules.
    """
    if not callable(getattr(nn.Module, "_wrapped_call_impl", None)):  # pragma: no cover - torch < 2.1
        raise RuntimeError(
            "activation_checkpointing_policy needs torch >= 2.1 (nn.Module._wrapped_call_impl)."
        )
    chosen: list[nn.Module] = []
    _skip_call_frames()

    def visit(module: nn.Module) -> None:
        if module in skip:
            return
        if is_checkpointed(module) or check(module):
            if not is_checkpointed(module):
                call = module.__dict__["_call_impl"] = _CheckpointedCall(module, mode)
                module.__dict__["compile"] = call.compile
                module.__dict__[_MARK] = True
                # Compiled already (module.compile()): its compiled call runs inside the checkpoint, since
                # nn.Module calls a compiled call directly, never the instance's _call_impl.
                call.compiled, module._compiled_call_impl = module._compiled_call_impl, None
            chosen.append(module)
            return
        for child in module.children():
            visit(child)

    if root not in skip:
        for child in root.children():
            visit(child)
    return chosen
