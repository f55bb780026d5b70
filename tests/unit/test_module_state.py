"""Engine state lives in objects owned by a root, a unit, a parameter or a process group (see docs/concepts.md,
"Who owns the engine's state"): what a module of the package holds at its top level is constant, apart from
the few process-wide objects named here, each with a comment at its definition saying why."""

from __future__ import annotations

import ast
import ctypes
import dataclasses
import datetime
import enum
import functools
import importlib
import logging
import pkgutil
import re
import types
import typing
from typing import Any

import torch

import flatshard

# module -> names of the process-wide mutable objects it may hold (at most four in all)
PROCESS_WIDE = {
    "flatshard.engine.log_once": {"_LOGGED"},  # "once" is per process
    "flatshard.engine.step.whole_tensor": {"_REGISTRY"},  # the user-facing optimizer class registry
    "flatshard.engine.transport.comm": {"comm_stats"},  # the user-facing communication counters
    "flatshard.engine.transport.groups": {"_STATES"},  # weakly keyed by process group, which owns its state
}

_CONSTANT_TYPES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    tuple,
    frozenset,
    range,
    types.MappingProxyType,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    type,
    enum.Enum,
    re.Pattern,
    logging.Logger,
    typing.TypeVar,
    torch.dtype,
    torch.device,
    property,
    staticmethod,
    classmethod,
    datetime.timedelta,
    ctypes.CDLL,  # a loaded C library
    # a memo of a pure function (a dtype's facts, a libc symbol, one wrapper per class): derived from
    # constants, the same whatever ran before, holding no model, tensor or process group
    functools._lru_cache_wrapper,
)


def _constant(value: Any) -> bool:
    if isinstance(value, _CONSTANT_TYPES) or (callable(value) and not hasattr(value, "__dict__")):
        return not isinstance(value, tuple) or all(_constant(v) for v in value)
    if isinstance(value, types.FunctionType) or typing.get_origin(value) is not None:
        return True  # functions, and aliases such as tuple[int, ...]
    cls = type(value)
    if cls is object:
        return True  # a sentinel
    if dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        return all(_constant(getattr(value, f.name)) for f in dataclasses.fields(value))
    return getattr(cls, "__slots__", None) == () and not hasattr(value, "__dict__")  # a stateless sentinel


def _modules() -> list[types.ModuleType]:
    names = [flatshard.__name__]
    names += [m.name for m in pkgutil.walk_packages(flatshard.__path__, prefix="flatshard.")]
    return [importlib.import_module(n) for n in sorted(names)]


def _defined(module: types.ModuleType) -> list[str]:
    """The names a module binds at its top level itself (not by importing)."""
    assert module.__file__ is not None
    names = []
    for node in ast.parse(open(module.__file__).read()).body:
        if isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
    return [n for n in names if not n.startswith("__")]


def test_module_level_state_is_constant_but_for_the_named_process_wide_objects() -> None:
    found = []
    for module in _modules():
        for name in _defined(module):
            value = getattr(module, name)
            if not _constant(value) and name not in PROCESS_WIDE.get(module.__name__, ()):
                found.append(f"{module.__name__}.{name}: {type(value).__name__}")
    assert not found, (
        "mutable module-level objects (make them constant, or owned by what they belong to):\n"
        + ("\n".join(found))
    )
    assert sum(len(v) for v in PROCESS_WIDE.values()) <= 4


def test_the_process_wide_objects_say_why() -> None:
    for module_name, names in PROCESS_WIDE.items():
        source = importlib.import_module(module_name).__file__
        assert source is not None
        lines = open(source).read().splitlines()
        for name in names:
            at = next(i for i, line in enumerate(lines) if re.match(rf"{name}\b.*=", line))
            assert lines[at - 1].startswith("#"), (
                f"{module_name}.{name} has no comment saying why it is process-wide"
            )
