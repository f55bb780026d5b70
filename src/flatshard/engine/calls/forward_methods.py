"""``register_forward_method``: a method other than ``forward`` (``generate``) gathers like the root's forward.

[Note: methods other than forward]
Hooks run around ``module(...)``, so a method such as a Hugging Face model's ``generate()`` called on a
sharded model does not gather: the parameters its first forward reaches outside an inner unit (embeddings,
the tied head) are 1-D shards. :func:`register_forward_method` replaces the method on the instance with a
call that first runs the forward pre-hooks of every unit enclosing the module, outermost (the root) first,
then the method, then their post-hooks: what calling the root's forward would gather, gathered for the whole
method. Units deeper down gather as their own forwards run inside it.

Inside such a call the forwards are not recorded in the execution order and prefetch nothing (a decode loop
runs the blocks once per token, which is not a training iteration's order). With ``keep_gathered`` (the
default) a unit gathered inside the call stays gathered until the method returns instead of resharding
after each forward: a 64-token decode loop all-gathers each unit once, not 64 times. The memory cost is
that of ``unshard_params``: by the end of the first forward every unit the method reaches is unsharded on
every rank (the whole model for ``generate``), until the method returns. ``keep_gathered=False`` keeps
FULL_SHARD's one-unit-at-a-time memory and gathers again for every forward. A backward through outputs
made inside the call works as after any forward: units regather for it.

Call a registered method on every rank, as any forward: it issues the same collectives. Inside
``unshard_params`` it runs on the full parameters without any (see [Note: forward inside unshard_params]).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from types import MethodType
from typing import Any

import torch.nn as nn

from flatshard.engine.runtime import UnitState, enclosing_units, forward_call

__all__ = ["is_forward_method", "register_forward_method", "register_generate"]


class _ForwardMethod:
    """The method as it is called after :func:`register_forward_method` (set on the instance).

    It keeps the method's function, not a bound method, so that copying or pickling the module gives a copy
    whose method calls the copy.
    """

    def __init__(self, module: nn.Module, name: str, method: Callable[..., Any], keep_gathered: bool) -> None:
        self.module = module
        self.name = name
        bound = isinstance(method, MethodType) and method.__self__ is module
        self.function: Callable[..., Any] = method.__func__ if bound else method  # type: ignore[attr-defined]
        self.bound = bound
        self.keep_gathered = keep_gathered
        functools.update_wrapper(self, method)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        chain = _enclosing_units(module)
        if not chain:
            raise ValueError(
                f"{type(module).__name__}.{self.name} was registered with flatshard.register_forward_method but "
                "the module is not inside a sharded module. HINT: shard the model (flatshard.shard) first."
            )
        root = chain[0]
        call = replace(root.call, method=True, keep_gathered=self.keep_gathered or root.call.keep_gathered)
        outermost = not root.call.method
        with forward_call(root.module, call):
            for state in chain:
                state._pre_forward(state.module, (), {})
            output = None
            try:
                output = (
                    self.function(module, *args, **kwargs) if self.bound else self.function(*args, **kwargs)
                )
            finally:
                for state in reversed(chain):
                    output = state._post_forward(state.module, (), output)
                if outermost and root.ctx is not None:
                    root.ctx.reshard_deferred()
        return output


def _enclosing_units(module: nn.Module) -> list[UnitState]:
    """The units whose module is ``module`` or contains it, outermost first."""
    return enclosing_units(module)


def register_forward_method(module: nn.Module, name: str, *, keep_gathered: bool = True) -> None:
    """Make ``module.<name>(...)`` gather what the root's forward would, like ``module(...)`` does.

    See [Note: methods other than forward]. Call the method on every rank. Registering again replaces the
    ``keep_gathered`` setting.

    Args:
        module: a unit, or a module inside one (after ``shard()``).
        name: the method's name, e.g. ``"generate"``; not ``"forward"`` (it gathers already).
        keep_gathered: units gathered inside the call stay gathered until it returns (a decode loop gathers
            each unit once; costs the unsharded model's parameter memory while it runs). Default: ``True``.
    """
    if name == "forward":
        raise ValueError("register_forward_method: forward already gathers. HINT: register another method.")
    if not isinstance(keep_gathered, bool):
        raise TypeError(
            f"keep_gathered must be a bool, got {type(keep_gathered).__name__}: {keep_gathered!r}."
        )
    current = getattr(module, name, None)
    if isinstance(current, _ForwardMethod):
        current.keep_gathered = keep_gathered
        return
    if not callable(current):
        raise ValueError(
            f"{type(module).__name__} has no method {name!r}. HINT: pass the name of a method of this module."
        )
    if not _enclosing_units(module):
        raise ValueError(
            f"register_forward_method: {type(module).__name__} is not inside a module sharded with flatshard.shard. "
            "HINT: shard the model first, then register its methods."
        )
    setattr(module, name, _ForwardMethod(module, name, current, keep_gathered))


def is_forward_method(module: nn.Module, name: str) -> bool:
    """Whether ``module.<name>`` was registered with :func:`register_forward_method`."""
    return isinstance(getattr(module, name, None), _ForwardMethod)


def register_generate(root: nn.Module) -> list[str]:
    """Register ``generate`` on every module at or under the sharded ``root`` whose class defines one (Hugging
    Face models, the example GPT); returns their names. What the Trainer and Fabric strategies do after
    sharding, so ``model.generate()`` works in any hook, after ``fit`` and in a Fabric loop."""
    names = []
    for name, module in root.named_modules():
        if callable(getattr(type(module), "generate", None)) and not is_forward_method(module, "generate"):
            register_forward_method(module, "generate")
            names.append(name or "<root>")
    return names
