"""What the estimator estimates: a ``module.path:factory`` built on the meta device, and one training step.

The factory returns a module, or ``(module, example_batch)``. It is called under ``torch.device("meta")``, so
``nn.Linear(8192, 8192)`` allocates nothing and nothing is downloaded as long as the factory builds the model
from a config (``from_config``, not ``from_pretrained``). A batch is a tensor (the forward's one argument), a
tuple or list (positional arguments) or a dict (keyword arguments); its tensors are moved to the meta device.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["Built", "EstimateError", "build", "loss_of", "resolve_factory", "training_step"]


class EstimateError(ValueError):
    """An estimate could not be made (a factory that fails, a bad option); the message ends with a HINT."""


Factory = Callable[[], Any]


class Built:
    """A model built on the meta device, and its example batch (``None`` when the factory gave none)."""

    def __init__(self, module: nn.Module, batch: Any | None) -> None:
        self.module = module
        self.batch = batch


def resolve_factory(target: str | Factory) -> Factory:
    """``"package.module:factory"`` (or the callable itself) -> the callable."""
    if callable(target):
        return target
    if not isinstance(target, str) or target.count(":") != 1 or not all(target.split(":")):
        raise EstimateError(
            f"target {target!r} is not of the form 'module.path:factory'. HINT: name an importable module and a "
            "callable in it that returns the model, e.g. 'flatshard.testing.llama:llama_8b'."
        )
    module_name, attr = target.split(":")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # like ``python -m``: a module in the current directory is importable
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # the module's own import error, whatever it is
        raise EstimateError(
            f"target {target!r}: importing {module_name!r} failed: {type(err).__name__}: {err}. HINT: check the "
            "module path, and run from the directory that holds it (or install its package)."
        ) from err
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EstimateError(
                f"target {target!r}: {module_name!r} has no attribute {attr!r}. HINT: the part after ':' names a "
                f"callable in the module; it defines {', '.join(n for n in dir(module) if not n.startswith('_'))[:300]}."
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise EstimateError(
            f"target {target!r} names a {type(obj).__name__}, not a callable. HINT: name a function (or class) "
            "that returns the model, or (model, example_batch)."
        )
    return obj  # type: ignore[no-any-return]


def _to_meta(batch: Any) -> Any:
    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, batch)


def build(factory: Factory, name: str) -> Built:
    """Call ``factory`` under the meta device and check what it returned."""
    try:
        with torch.device("meta"):
            result = factory()
    except EstimateError:
        raise
    except Exception as err:
        raise EstimateError(
            f"the factory {name} raised {type(err).__name__}: {err}. HINT: the factory runs under "
            "torch.device('meta'): build the model from its config (no from_pretrained, no reading weights, no "
            "tensor values such as .item()); run it on its own to see the full traceback."
        ) from err
    batch = None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module):
        result, batch = result
    if not isinstance(result, nn.Module):
        raise EstimateError(
            f"the factory {name} returned {type(result).__name__}, not a module. HINT: return an nn.Module, or "
            "(module, example_batch)."
        )
    real = [n for n, t in (*result.named_parameters(), *result.named_buffers()) if not t.is_meta]
    if real:
        raise EstimateError(
            f"the factory {name} built {len(real)} tensors outside the meta device (first: {real[0]!r}). HINT: "
            "create the model inside the factory (it runs under torch.device('meta')), not at import time, and "
            "do not move it to a device."
        )
    if not any(True for _ in result.parameters()):
        raise EstimateError(
            f"the factory {name} returned a module without parameters. HINT: return the model."
        )
    if batch is not None:
        if not [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]:
            raise EstimateError(
                f"the example batch of {name} holds no tensor ({type(batch).__name__}). HINT: return (module, "
                "batch) with batch a tensor, a tuple of forward arguments or a dict of keyword arguments."
            )
        batch = _to_meta(batch)
    return Built(result, batch)


def loss_of(output: Any) -> torch.Tensor:
    """The scalar a training step differentiates: the output if it is a scalar, its ``loss`` (attribute or key),
    else the sum of its first floating-point tensor, in fp32 (as a loss function would reduce logits)."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    for t in tree_flatten(output if not hasattr(output, "to_tuple") else output.to_tuple())[0]:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
            return t.float().sum()
    raise EstimateError(
        f"the model's output ({type(output).__name__}) holds no tensor that requires grad. HINT: return a loss, or "
        "outputs computed from the parameters."
    )


def call(module: nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return module(**batch)
    if isinstance(batch, (tuple, list)):
        return module(*batch)
    return module(batch)


def training_step(
    module: nn.Module,
    batch: Any,
    optimizer: torch.optim.Optimizer | None,
    mark: Callable[[str], None] | None = None,
) -> torch.Tensor:
    """One training step in Lightning's order: forward and loss, ``zero_grad(set_to_none=True)``, backward,
    optimizer step. The estimator's dry run and the real runs that check it both run exactly this; ``mark``
    is called with ``"forward"`` once the loss is computed."""
    loss = loss_of(call(module, batch))
    if mark is not None:
        mark("forward")
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    else:
        for p in module.parameters():
            p.grad = None
    loss.backward()
    if optimizer is not None:
        optimizer.step()
    return loss
