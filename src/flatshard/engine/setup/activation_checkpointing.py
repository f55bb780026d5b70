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
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from flatshard.engine.setup.wrap import resolve_policy

__all__ = [
    "apply_activation_checkpointing",
    "checkpointed_call",
    "is_checkpointed",
    "resolve_checkpointing_policy",
]

_MARK = "_flatshard_checkpointed"

CheckFn = Callable[[nn.Module], bool]


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
    traced: checkpointing runs eagerly around the compiled call (see [Note: torch.compile]).
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.compiled: Callable[..., Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = self.compiled or type(self.module)._call_impl.__get__(self.module)
        if not torch.is_grad_enabled():  # nothing to save: no point recomputing
            return call(*args, **kwargs)
        return checkpoint(call, *args, use_reentrant=False, **kwargs)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """The checkpointed module's ``compile`` (set on the module): the compiled call ``nn.Module.compile``
        makes, kept here to run inside the checkpoint, since ``nn.Module`` would call it directly."""
        self.compiled = torch.compile(type(self.module)._call_impl.__get__(self.module), *args, **kwargs)


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


def apply_activation_checkpointing(root: nn.Module, check: CheckFn, skip: set[nn.Module]) -> list[nn.Module]:
    """Checkpoint the outermost modules below ``root`` for which ``check`` is true.

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
                call = module.__dict__["_call_impl"] = _CheckpointedCall(module)
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
