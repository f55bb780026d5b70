"""``torch.compile`` on a sharded model: units compile, flatshard's hooks stay outside every graph.

[Note: torch.compile]
A unit's hooks cannot be traced: they take locks, issue collectives, keep a state machine and put new tensors
on the modules. So they are kept out of compiled graphs, and the rest is arranged so that no graph has to
break around them:

1. **Hooks run eagerly.** Every forward hook flatshard puts on a unit (and its backward hooks) is wrapped in
   ``torch.compiler.disable`` (``runtime._OutsideGraphs``: when ``shard()`` registers it, so that importing
   flatshard does not import dynamo, but sharding does). Dynamo never traces a module's ``_call_impl``
   frame itself (``torch.nn`` is skipped at the top level) and skips the disabled hooks it calls, so a
   compiled unit (``module.compile()``) runs its hooks eagerly, then its ``forward`` frame compiled: the
   graph sees the gathered parameters as inputs, and its backward is one node whose gradients reach the
   unit's views as in eager mode (see [Note: gradients of a unit]).
2. **The units that compile are the ones with no unit inside** (:func:`leaf_units`). A module whose forward
   calls a unit would have to trace that unit's hooks, and would break its graph there. So the forward of
   every module that encloses a unit is *sealed* by ``shard()`` (:func:`seal_enclosing_forwards`): its own
   frame runs eagerly (``torch.compiler.disable(recursive=False)``, set on the instance), while the frames it
   calls still compile. Compiling the whole model, ``torch.compile(model)``, ``model.compile()`` or
   ``fabric.setup(torch.compile(model))``, therefore compiles each unit's forward on its own (and any other
   submodule the sealed forwards call), the same graphs as compiling the units one by one. The cost: code in
   the root's own forward (an embedding, a final norm and head) runs eagerly; give it a unit of its own to
   compile it.
3. **No recompilation once training runs.** The views a unit's forward sees are new tensors every step, but
   with the same shapes, strides, dtypes and ``requires_grad``: the guards of the first step's graphs hold.
   A forward without gradients (evaluation) compiles one more graph per unit (its inputs do not require
   grad), and so does a forward inside ``unshard_params`` (the modules hold the Parameters there).
4. **Activation checkpointing.** A checkpointed unit runs its whole call under ``torch.utils.checkpoint``
   (see [Note: activation checkpointing]), which turns dynamo off inside it, so compiling the unit's call
   would trace the checkpoint and the hooks in it. Instead the checkpoint runs eagerly (dynamo skips its
   frame) around a compiled call of the unit's own (``torch.compile`` of its ``_call_impl``, what
   ``module.compile()`` makes: a checkpointed module's ``compile`` puts it there, and a module compiled before
   sharding has it moved there): the compiled forward runs in forward and again, compiled, in the
   recomputation. A whole-model compile cannot reach inside such a unit, which then runs eagerly: compile the
   unit itself. A checkpointed module inside a compiled unit is traced by dynamo like any checkpoint.
   Selective checkpointing (see [Note: selective checkpointing]) needs the compiler to see the checkpoint: its
   policy chooses among the graph's operators, and compiled kernels run outside the dispatch mode that applies
   it eagerly. So a compiled selective unit (``compile()``, with a forward of its class's own) runs its hooks
   eagerly and its forward compiled *with* the checkpoint inside: dynamo traces the checkpoint and its
   ``context_fn``, and the partitioner keeps the chosen operators' outputs and recomputes the rest inside the
   compiled backward. The hooks are not run again: the compiled backward recomputes from the gathered
   parameters the pre-backward hook provides, as any compiled unit's backward does. Compiled code that still
   runs inside an eager selective checkpoint (a whole-model compile reaching a checkpointed submodule) is
   recomputed whole: the policy keeps functional operators only, never the ``out=`` calls compiled kernels make.

:func:`compile_units` is what the strategies' ``compile`` argument does after sharding. A unit compiled
already (``block.compile()`` in ``configure_model``) keeps its own settings.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from types import MethodType
from typing import Any

import torch
import torch.nn as nn

from flatshard.engine.runtime import get_unit_state, unit_states
from flatshard.engine.setup.activation_checkpointing import checkpointed_call

__all__ = ["compile_kwargs", "compile_units", "leaf_units", "seal_enclosing_forwards"]

_EXAMPLE = "compile=True, or compile={'backend': 'inductor', 'mode': 'max-autotune'}"


def _compile_parameters() -> list[str]:
    """``torch.compile``'s keyword arguments (all but the model)."""
    return [name for name in inspect.signature(torch.compile).parameters if name != "model"]


def compile_kwargs(value: object, arg: str = "compile") -> dict[str, Any] | None:
    """``compile`` as given to a strategy -> the ``torch.compile`` keyword arguments, or ``None`` (off).

    ``False`` / ``None``: off. ``True``: ``torch.compile``'s defaults. A mapping: keyword arguments of
    ``torch.compile`` (``backend``, ``mode``, ``fullgraph``, ``dynamic``, ``options``, ``disable``), checked by
    name and kind here, so a typo fails when the strategy is built, not after the model is sharded.
    """
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        hint = (
            f" HINT: a mode goes in a dict: {arg}={{'mode': {value!r}}}."
            if isinstance(value, str)
            else f" HINT: {_EXAMPLE}."
        )
        raise TypeError(
            f"{arg} must be a bool or a dict of torch.compile keyword arguments, got {type(value).__name__}: "
            f"{value!r}.{hint}"
        )
    allowed = _compile_parameters()
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise ValueError(
            f"{arg} has keys that torch.compile does not take: {unknown}. HINT: use {', '.join(allowed)}."
        )
    kwargs = dict(value)
    _check_kinds(arg, kwargs)
    return kwargs


def _check_kinds(arg: str, kwargs: dict[str, Any]) -> None:
    backend = kwargs.get("backend", "inductor")
    if not (isinstance(backend, str) or callable(backend)):
        raise TypeError(
            f"{arg}['backend'] must be a backend name or a callable, got {type(backend).__name__}: {backend!r}. "
            "HINT: 'inductor', 'aot_eager', 'eager', or see torch._dynamo.list_backends()."
        )
    for key in ("fullgraph", "disable"):
        if key in kwargs and not isinstance(kwargs[key], bool):
            raise TypeError(f"{arg}[{key!r}] must be a bool, got {type(kwargs[key]).__name__}.")
    if "dynamic" in kwargs and not (kwargs["dynamic"] is None or isinstance(kwargs["dynamic"], bool)):
        raise TypeError(f"{arg}['dynamic'] must be True, False or None, got {kwargs['dynamic']!r}.")
    if "mode" in kwargs and not (kwargs["mode"] is None or isinstance(kwargs["mode"], str)):
        raise TypeError(f"{arg}['mode'] must be a string such as 'max-autotune', got {kwargs['mode']!r}.")
    if "options" in kwargs and not (kwargs["options"] is None or isinstance(kwargs["options"], Mapping)):
        raise TypeError(f"{arg}['options'] must be a dict of backend options, got {kwargs['options']!r}.")
    if kwargs.get("mode") is not None and kwargs.get("options") is not None:
        raise ValueError(
            f"{arg} gives both 'mode' and 'options'; torch.compile takes one of them. HINT: drop one, e.g. put "
            "the mode's settings in 'options'."
        )


def _is_unit(module: nn.Module) -> bool:
    return get_unit_state(module) is not None


def _enclosing(root: nn.Module) -> tuple[list[nn.Module], set[nn.Module]]:
    """The units at or below ``root`` (``.modules()`` order) and the modules that have a unit strictly inside."""
    units = [m for m in root.modules() if _is_unit(m)]
    outer: set[nn.Module] = set()
    seen: dict[nn.Module, bool] = {}

    def holds_unit(module: nn.Module) -> bool:  # a unit at or below ``module``
        if module not in seen:
            seen[module] = False  # a module reachable from itself (never in practice) ends here
            inside = [holds_unit(child) for child in module.children()]
            if any(inside):
                outer.add(module)
            seen[module] = _is_unit(module) or any(inside)
        return seen[module]

    holds_unit(root)
    return units, outer


def leaf_units(module: nn.Module) -> list[nn.Module]:
    """The units at or below ``module`` with no unit inside them, in ``.modules()`` order: the modules that
    compile (see [Note: torch.compile])."""
    units, outer = _enclosing(module)
    return [u for u in units if u not in outer]


@functools.cache
def _eager_frame(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` whose own frame dynamo skips while still compiling the frames it calls (one per class)."""
    return torch.compiler.disable(forward, recursive=False)  # type: ignore[no-any-return]


def seal_enclosing_forwards(root: nn.Module) -> list[nn.Module]:
    """Seal the forward of every module at or below ``root`` that has a unit inside (see [Note:
    torch.compile], item 2); returns the modules sealed now. A module without a forward of its own (a
    ``ModuleList``) or with one set on the instance (by the user, or sealed before) is left alone.

    The sealed forward is the class's, bound to the module, so a copy of the module calls the copy.
    """
    _, outer = _enclosing(root)
    sealed = []
    for module in root.modules():
        forward = type(module).forward
        if module not in outer or "forward" in module.__dict__ or forward is nn.Module.forward:
            continue
        module.__dict__["forward"] = MethodType(_eager_frame(forward), module)
        sealed.append(module)
    return sealed


def compile_units(module: nn.Module, kwargs: Mapping[str, Any], *, root: bool = True) -> list[nn.Module]:
    """Compile in place (``unit.compile(**kwargs)``) every unit of the sharded ``module`` that has no unit
    inside it; returns the units compiled now. A unit compiled already keeps its compilation.

    Args:
        module: a module sharded with ``shard()`` (the root).
        kwargs: ``torch.compile`` keyword arguments (see :func:`compile_kwargs`).
        root: whether ``module`` itself may be compiled, when it is the only unit. The Trainer strategy says
            no: its root's forward runs ``training_step``. Default: ``True``.
    """
    if not _is_unit(module):
        raise ValueError(
            f"compile_units needs a module sharded with flatshard.shard, and {type(module).__name__} is not one. "
            "HINT: shard the model first."
        )
    if any(h.tensor_parallel is not None for s in unit_states(module) for h in s.handles):
        raise ValueError(
            "compile with tensor parallelism is not supported: torch's compiled backward of a unit whose "
            "parameters are DTensor views fails to redistribute their gradients (torch 2.13, CPU). HINT: set "
            "compile=False for a tensor-parallel model (see docs/guide.md, Limits)."
        )
    units = [u for u in leaf_units(module) if root or u is not module]
    if not units:
        raise ValueError(
            f"compile: {type(module).__name__} is the only unit, and its forward runs the training step, which is "
            "not compiled. HINT: set auto_wrap_policy (e.g. {TransformerBlock}) so the layers are units, or call "
            "block.compile() on submodules in configure_model."
        )
    compiled = []
    for unit in units:
        if not _is_compiled(unit):
            unit.compile(**kwargs)  # checkpointed: its compiled call runs inside the checkpoint (item 4)
            compiled.append(unit)
    return compiled


def _is_compiled(unit: nn.Module) -> bool:
    checkpointed = checkpointed_call(unit)
    return unit._compiled_call_impl is not None or (
        checkpointed is not None and checkpointed.compiled is not None
    )
