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

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from flatshard.engine.wrap import resolve_policy

__all__ = ["apply_activation_checkpointing", "is_checkpointed", "resolve_checkpointing_policy"]

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
    """The instance-level ``_call_impl`` of a checkpointed module (picklable with its module)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = type(self.module)._call_impl.__get__(self.module)
        if not torch.is_grad_enabled():  # nothing to save: no point recomputing
            return call(*args, **kwargs)
        return checkpoint(call, *args, use_reentrant=False, **kwargs)


def is_checkpointed(module: nn.Module) -> bool:
    return bool(module.__dict__.get(_MARK, False))


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

    def visit(module: nn.Module) -> None:
        if module in skip:
            return
        if is_checkpointed(module) or check(module):
            if not is_checkpointed(module):
                module.__dict__["_call_impl"] = _CheckpointedCall(module)
                module.__dict__[_MARK] = True
            chosen.append(module)
            return
        for child in module.children():
            visit(child)

    if root not in skip:
        for child in root.children():
            visit(child)
    return chosen
