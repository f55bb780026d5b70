"""Wrap policies and unit planning (no processes)."""

from __future__ import annotations

import functools

import pytest
import torch.nn as nn

from flatshard.engine.setup.wrap import plan_units, resolve_policy, select_unit_modules
from flatshard.testing.models import Block, TinyGPT


def _units(model: nn.Module, policy: object) -> list[nn.Module]:
    return select_unit_modules(model, resolve_policy(policy), set(), set())


def test_class_policy_selects_blocks_in_module_order() -> None:
    model = TinyGPT(n_layer=3)
    units = _units(model, {Block})
    assert units[0] is model and units[1:] == list(model.blocks)


def test_class_policy_from_import_paths() -> None:
    model = TinyGPT(n_layer=2)
    assert _units(model, ["flatshard.testing.models.Block"])[1:] == list(model.blocks)


def test_size_policy_skips_containers_and_counts_remainders() -> None:
    model = TinyGPT(n_layer=3)
    units = _units(model, 700)
    assert model.blocks not in units
    assert all(isinstance(u, Block) for u in units[1:]) and len(units) == 4


def test_callable_policy_follows_torch_contract() -> None:
    calls = []

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        calls.append((type(module).__name__, recurse, nonwrapped_numel))
        return recurse or isinstance(module, nn.LayerNorm)

    model = TinyGPT(n_layer=1)
    units = _units(model, policy)
    assert {type(u) for u in units[1:]} == {nn.LayerNorm}
    assert ("TinyGPT", True, sum(p.numel() for p in model.parameters())) in calls


def test_torch_size_based_policy_partial_is_accepted() -> None:
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=700)
    assert all(isinstance(u, Block) for u in _units(TinyGPT(), policy)[1:])


@pytest.mark.parametrize("bad", [3.5, "Block", True, [1, 2], object()])
def test_bad_policy_types_are_rejected(bad: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        resolve_policy(bad)


def test_policy_selecting_a_container_without_forward_raises() -> None:
    with pytest.raises(ValueError, match="no forward"):
        _units(TinyGPT(), {nn.ModuleList})


def test_tied_weight_goes_to_lowest_common_ancestor() -> None:
    model = TinyGPT(n_layer=2, tie=True)
    units = [model, model.wte, *model.blocks]  # embedding as its own unit; head stays in the root
    plans = plan_units(model, units, set(), set(), set())
    by_module = {id(p.module): p for p in plans}
    root_params = by_module[id(model)].params
    assert any(p is model.wte.weight for p in root_params)
    assert by_module[id(model.wte)].params == []
    aliases = by_module[id(model)].aliases[
        next(i for i, p in enumerate(root_params) if p is model.wte.weight)
    ]
    assert {(type(m).__name__, n) for m, n in aliases} == {("Embedding", "weight"), ("Linear", "weight")}


def test_every_parameter_planned_once_and_ignored_skipped() -> None:
    model = TinyGPT(n_layer=3)
    ignored = set(model.blocks[1].modules())
    units = select_unit_modules(model, resolve_policy({Block}), ignored, set())
    assert model.blocks[1] not in units
    plans = plan_units(model, units, ignored, set(), set())
    planned = [p for plan in plans for p in plan.params]
    assert len({id(p) for p in planned}) == len(planned)
    expected = {id(p) for p in model.parameters()} - {id(p) for p in model.blocks[1].parameters()}
    assert {id(p) for p in planned} == expected
