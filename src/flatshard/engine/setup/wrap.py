"""Wrap policies and unit planning: which modules become units, which parameters each unit owns.

[Note: unit planning]
Units are chosen top-down with the same recursive contract as torch FSDP's ``auto_wrap_policy``:
``policy(module, recurse=True, nonwrapped_numel)`` asks whether to look inside a module,
``policy(module, recurse=False, nonwrapped_numel)`` whether to make it a unit, where ``nonwrapped_numel``
counts the parameters below it that no inner unit took. The root is always a unit. A submodule that
was already sharded by an earlier ``shard()`` call (manual nesting) is a finished unit: planning does
not look inside it.

Parameters are then assigned by walking the module tree left-to-right depth-first (``.modules()``
order): a parameter reachable from several modules (tied weights, shared submodules) belongs to the
deepest unit that encloses all of them, i.e. their lowest common ancestor unit, so it is gathered for
as long as any user of it runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Union

import torch.nn as nn

__all__ = [
    "Alias",
    "ModuleClassPolicy",
    "Policy",
    "PolicyLike",
    "SizePolicy",
    "UnitPlan",
    "plan_units",
    "resolve_policy",
    "select_unit_modules",
]

Policy = Callable[[nn.Module, bool, int], bool]
PolicyLike = Union[
    Policy, int, "set[type[nn.Module]]", "list[type[nn.Module]]", "set[str]", "list[str]", None
]

Alias = tuple[nn.Module, str]  # (module holding the parameter, attribute name)


def _import_class(path: str) -> type[nn.Module]:
    module_name, _, cls_name = path.rpartition(".")
    if not module_name:
        raise ValueError(
            f"auto_wrap_policy entry {path!r} is not an import path. HINT: use 'package.module.Class'."
        )
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"auto_wrap_policy entry {path!r} could not be imported: {err}") from err
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"auto_wrap_policy entry {path!r} is not an nn.Module subclass.")
    return cls


class ModuleClassPolicy:
    """Make every module of one of ``classes`` a unit (picklable, so strategies can be sent to workers)."""

    def __init__(self, classes: tuple[type[nn.Module], ...]) -> None:
        self.classes = classes

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return recurse or isinstance(module, self.classes)

    def __repr__(self) -> str:
        return f"ModuleClassPolicy({', '.join(c.__name__ for c in self.classes)})"


class SizePolicy:
    """Make a module a unit once it holds ``min_num_params`` parameters no inner unit took."""

    _containers = (nn.ModuleList, nn.ModuleDict)

    def __init__(self, min_num_params: int) -> None:
        self.min_num_params = min_num_params

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        large = nonwrapped_numel >= self.min_num_params
        return large if recurse else large and not isinstance(module, self._containers)

    def __repr__(self) -> str:
        return f"SizePolicy(min_num_params={self.min_num_params})"


def resolve_policy(policy: Any, arg: str = "auto_wrap_policy") -> Policy | None:
    """Normalise a policy given as ``None``, an int, classes (or their import paths), or a callable."""
    if policy is None:
        return None
    if isinstance(policy, bool):
        raise TypeError(
            f"{arg}={policy!r}: a bool is not a policy. HINT: pass an int, a set of classes or a callable."
        )
    if isinstance(policy, int):
        if policy <= 0:
            raise ValueError(f"{arg}={policy}: a size policy needs a positive minimum parameter count.")
        return SizePolicy(policy)
    if isinstance(policy, type) and issubclass(policy, nn.Module):
        return ModuleClassPolicy((policy,))
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = []
        for entry in policy:
            if isinstance(entry, str):
                classes.append(_import_class(entry))
            elif isinstance(entry, type) and issubclass(entry, nn.Module):
                classes.append(entry)
            else:
                raise TypeError(
                    f"{arg} contains {entry!r} ({type(entry).__name__}), which is not an nn.Module subclass. "
                    "HINT: pass module classes, e.g. {TransformerBlock}, or their import paths."
                )
        if not classes:
            raise ValueError(f"{arg} is an empty collection. HINT: pass None for no policy.")
        return ModuleClassPolicy(tuple(classes))
    if callable(policy):
        return policy  # type: ignore[no-any-return]
    raise TypeError(
        f"{arg} must be None, an int (minimum parameters per unit), a set of nn.Module classes, or a callable "
        f"(module, recurse, nonwrapped_numel) -> bool; got {type(policy).__name__}: {policy!r}."
    )


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def select_unit_modules(
    root: nn.Module,
    policy: Policy | None,
    ignored: set[nn.Module],
    finished_units: set[nn.Module],
) -> list[nn.Module]:
    """Modules that become new units under ``root`` (root first), in ``.modules()`` order."""
    chosen: set[nn.Module] = set()
    counted: set[int] = set()

    def numel_below(module: nn.Module) -> int:
        seen: set[int] = set()
        total = 0
        for sub in _walk(module, ignored, stop_at=finished_units - {module}):
            for p in sub._parameters.values():
                if p is not None and id(p) not in seen and id(p) not in counted:
                    seen.add(id(p))
                    total += p.numel()
        return total

    def recurse(module: nn.Module) -> int:
        if module in ignored or module in finished_units:
            return 0
        nonwrapped = numel_below(module)
        if not policy(module, True, nonwrapped):  # type: ignore[misc]
            return 0
        wrapped = sum(recurse(child) for child in module.children())
        if module is not root and policy(module, False, nonwrapped - wrapped):  # type: ignore[misc]
            if not _has_forward(module):
                raise ValueError(
                    f"auto_wrap_policy selected {type(module).__name__} "
                    f"({_name_of(root, module)!r}), which has no forward(); its parameters would never be "
                    "gathered. HINT: select the modules inside the container instead, e.g. the block class."
                )
            chosen.add(module)
            for sub in _walk(module, ignored, stop_at=finished_units):
                counted.update(id(p) for p in sub._parameters.values() if p is not None)
            return nonwrapped
        return wrapped

    if policy is not None:
        recurse(root)
    return [root] + [m for m in root.modules() if m in chosen and m is not root]


def _walk(module: nn.Module, ignored: set[nn.Module], stop_at: set[nn.Module]) -> Iterable[nn.Module]:
    """Depth-first (``.modules()`` order) modules below ``module``, skipping ignored and stop_at subtrees."""
    stack = [module]
    seen: set[int] = set()
    while stack:
        m = stack.pop()
        if id(m) in seen or m in ignored:
            continue
        seen.add(id(m))
        yield m
        if m is not module and m in stop_at:
            continue
        stack.extend(reversed([c for c in m._modules.values() if c is not None]))


def _name_of(root: nn.Module, target: nn.Module) -> str:
    for name, m in root.named_modules():
        if m is target:
            return name or "<root>"
    return type(target).__name__


@dataclass
class UnitPlan:
    """What one new unit owns: parameters in flattening order and every place each one is held."""

    module: nn.Module
    params: list[nn.Parameter] = field(default_factory=list)
    aliases: list[list[Alias]] = field(default_factory=list)


def plan_units(
    root: nn.Module,
    unit_modules: list[nn.Module],
    ignored: set[nn.Module],
    finished_units: set[nn.Module],
    managed_params: set[nn.Parameter],
) -> list[UnitPlan]:
    """Assign every parameter under ``root`` to its lowest common ancestor unit (see [Note: unit planning]).

    ``finished_units`` are units of earlier ``shard()`` calls and ``managed_params`` their parameters:
    they are left as they are, and sharing one of them outside its unit is an error.
    """
    unit_set = set(unit_modules)
    plans = {m: UnitPlan(m) for m in unit_modules}
    order: list[nn.Parameter] = []
    chains: dict[nn.Parameter, list[tuple[nn.Module, ...]]] = {}
    aliases: dict[nn.Parameter, list[Alias]] = {}
    path_of: dict[nn.Parameter, str] = {}

    def visit(
        module: nn.Module, chain: tuple[nn.Module, ...], prefix: str, finished: nn.Module | None
    ) -> None:
        if module in ignored:
            return
        if finished is None and module in finished_units:
            finished = module
        if finished is None and module in unit_set and (not chain or chain[-1] is not module):
            chain = (*chain, module)
        for name, p in module._parameters.items():
            if p is None:
                continue
            owner_finished = p in managed_params
            if finished is not None and not owner_finished:
                continue  # ignored inside the finished unit
            if owner_finished and finished is None:
                raise ValueError(
                    f"Parameter {prefix + name!r} belongs to an already sharded submodule but is also used by "
                    f"{type(module).__name__} outside it. HINT: shard their common ancestor instead (apply "
                    "shard() to the outer module only), or untie the parameter."
                )
            if owner_finished:
                continue
            if p not in chains:
                order.append(p)
                chains[p], aliases[p] = [], []
                path_of[p] = prefix + name
            chains[p].append(chain)
            if (module, name) not in aliases[p]:
                aliases[p].append((module, name))
        for child_name, child in module._modules.items():
            if child is not None:
                visit(child, chain, f"{prefix}{child_name}.", finished)

    visit(root, (), "", None)
    for p in order:
        common = chains[p][0]
        for c in chains[p][1:]:
            n = 0
            while n < min(len(common), len(c)) and common[n] is c[n]:
                n += 1
            common = common[:n]
        plan = plans[common[-1]]
        plan.params.append(p)
        plan.aliases.append(aliases[p])
    return [plans[m] for m in unit_modules]
