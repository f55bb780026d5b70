"""The strategy names (``"flatshard"``, ...) in Lightning's Trainer and Fabric registries, without importing Lightning.

[Note: registering without importing Lightning]
``import flatshard`` must make ``Trainer(strategy="flatshard")`` and ``Fabric(strategy="flatshard")`` work,
but importing Lightning costs seconds, and plain-PyTorch users of :func:`flatshard.shard` (and every
spawned rank of the distributed tests) should not pay for it. So:

* the registries get *factories*, not classes: a registry entry is only called, with its init
  arguments, when the Trainer or Fabric resolves the name, and the factory imports the strategy then;
* if Lightning's strategy modules are already imported, the names are added at once; otherwise a
  finder on ``sys.meta_path`` adds them right after Lightning executes those modules, before any
  Trainer or Fabric can look a name up. The finder touches nothing else and steps aside for every
  other module.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType, ModuleType
from typing import Any

from flatshard.strategy_names import register_names

__all__ = ["install", "register"]


def _trainer_strategy(**kwargs: Any) -> Any:
    from flatshard.lightning.strategy import FlatShardStrategy

    return FlatShardStrategy(**kwargs)


def _fabric_strategy(**kwargs: Any) -> Any:
    from flatshard.lightning.fabric import FlatShardFabricStrategy

    return FlatShardFabricStrategy(**kwargs)


# module that defines a registry -> (registry attribute, factory)
_REGISTRIES: Mapping[str, tuple[str, Callable[..., Any]]] = MappingProxyType(
    {
        "lightning.pytorch.strategies": ("StrategyRegistry", _trainer_strategy),
        "lightning.fabric.strategies": ("STRATEGY_REGISTRY", _fabric_strategy),
    }
)


def _register_module(module: ModuleType) -> None:
    attribute, factory = _REGISTRIES[module.__name__]
    registry = getattr(module, attribute, None)
    if registry is not None:
        register_names(registry, factory)


def register() -> None:
    """Register the names with the Trainer and Fabric registries now (imports Lightning). Idempotent."""
    import lightning.fabric.strategies
    import lightning.pytorch.strategies

    _register_module(lightning.pytorch.strategies)
    _register_module(lightning.fabric.strategies)


class _RegisteringLoader(importlib.abc.Loader):
    """Runs a registry module as its own loader would, then adds the names."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _register_module(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ...: the inner loader's
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the registry modules it wraps the loader the other finders return."""

    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _REGISTRIES or getattr(self._busy, "name", None) == fullname:
            return None
        self._busy.name = fullname
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.name = None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _RegisteringLoader(spec.loader)
        return spec


def install() -> None:
    """Register the names in the registries already imported, and in the others once they are imported."""
    for name in _REGISTRIES:
        module = sys.modules.get(name)
        if module is not None:
            _register_module(module)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):  # the import system owns the one finder
        sys.meta_path.insert(0, _Finder())
