"""Where each parameter of a whole-tensor optimizer stands (see [Note: whole-tensor optimizers]): the transitions
into a step and back are the only ones allowed, a wrong one raises naming the parameter, its state and the rank;
a step that raised is recovered from; the plan lives on its optimizer, is made again when the parameters change
and goes with the optimizer. No processes: a one-rank handle stands in for a unit's shard."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn as nn

from flatshard.engine import whole_tensor_owners
from flatshard.engine.handle import FlatParamHandle
from flatshard.engine.step import whole_tensor
from flatshard.engine.step.whole_plan import (
    WholeGroup,
    WholeParam,
    WholeState,
    WholeTensorPlan,
    assign_owners,
    existing_plan,
    plan_for,
)

PIECE, WHOLE, SKIPPED = WholeState.PIECE, WholeState.WHOLE_ON_OWNER, WholeState.SKIPPED_ON_NON_OWNER


def _param(owner: int, rank: int) -> WholeParam:
    p = nn.Parameter(torch.randn(4, 3))
    handle = FlatParamHandle([p], [[]], ["block.weight"], None, None, torch.device("cpu"))
    return WholeParam(p, handle, 0, "block.weight", owner, rank, torch.Size([4, 3]), [6, 6], [0, 6])


@pytest.mark.parametrize(("owner", "inside"), [(0, WHOLE), (1, SKIPPED)])
def test_a_parameter_goes_into_a_step_and_back(owner: int, inside: WholeState) -> None:
    q = _param(owner, rank=0)
    assert q.state is PIECE
    q.move_to(inside, "the test's step")
    assert q.state is inside
    q.move_to(PIECE, "the test's step")
    assert q.state is PIECE


@pytest.mark.parametrize(
    ("owner", "start", "to", "says"),
    [
        (0, PIECE, PIECE, "is a piece on rank 0, but the test's step needs it whole on its owner or skipped"),
        (0, WHOLE, SKIPPED, "is whole on its owner on rank 0, but the test's step needs it a piece"),
        (1, SKIPPED, WHOLE, "is skipped on a non-owner on rank 0, but the test's step needs it a piece"),
        (1, PIECE, WHOLE, "would be whole on its owner on rank 0, its owner is rank 1"),
        (0, PIECE, SKIPPED, "would be skipped on a non-owner on rank 0, its owner is rank 0"),
    ],
)
def test_a_wrong_transition_raises_naming_the_parameter(
    owner: int, start: WholeState, to: WholeState, says: str
) -> None:
    q = _param(owner, rank=0)
    q.state = start
    with pytest.raises(RuntimeError, match="HINT") as err:
        q.move_to(to, "the test's step")
    assert "'block.weight'" in str(err.value) and says in str(err.value), str(err.value)
    assert q.state is start  # nothing changed


def test_check_state_names_what_needed_the_state() -> None:
    q = _param(0, rank=0)
    q.check_state(PIECE, doing="a save")
    q.state = WHOLE
    with pytest.raises(
        RuntimeError, match=r"whole on its owner on rank 0, but a save needs it a piece\. HINT"
    ):
        q.check_state(PIECE, doing="a save")


def test_recover_puts_the_pieces_back_after_a_step_that_raised() -> None:
    owned, other = _param(0, rank=0), _param(1, rank=0)
    plan = WholeTensorPlan((), [WholeGroup(None, 2, 0, torch.device("cpu"), torch.float32, [owned, other])])
    grads = []
    for q, state in ((owned, WHOLE), (other, SKIPPED)):
        grads.append(torch.ones(4, 3))
        q.grad_piece = grads[-1]
        q.whole = torch.zeros(4, 3)
        q.move_to(state, "the test's step")
    owned.param.data = owned.whole  # what the exchange does on the owner
    owned.param.grad, other.param.grad = torch.full((4, 3), 2.0), None
    assert plan.in_step()
    plan.recover()
    assert not plan.in_step()
    for q, grad in zip((owned, other), grads, strict=True):
        assert q.state is PIECE and q.whole is None and q.grad_piece is None
        assert q.param.grad is grad
        assert q.param.data_ptr() == q.piece().data_ptr()  # the shard's piece again, not the owner's copy


def test_the_plan_lives_on_its_optimizer() -> None:
    model = nn.Linear(3, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert existing_plan(opt) is None
    plan = plan_for(opt)
    assert plan.groups == []  # nothing sharded: nothing to make whole
    assert existing_plan(opt) is plan and plan_for(opt) is plan
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    assert plan_for(opt) is not plan  # other parameters: planned again
    assert existing_plan(copy.deepcopy(opt)) is None  # a copy plans for itself
    gone = weakref.ref(existing_plan(opt))
    del opt, plan
    gc.collect()
    assert gone() is None  # released with the optimizer


def test_owners_match_the_planning_tools() -> None:
    shapes = [torch.Size(s) for s in [(64, 64), (64, 256), (256, 64), (64,), (8, 8), (64, 64)]]
    owners = assign_owners(shapes, 3)
    assert owners == whole_tensor_owners(shapes, 3)
    assert sorted(set(owners)) == [0, 1, 2]
    assert owners[1] != owners[2]  # the two largest go to different ranks


class _Declared(torch.optim.SGD):
    pass


def test_hooks_install_once() -> None:
    whole_tensor.install_hooks()
    hooks = whole_tensor._REGISTRY._hooks
    assert hooks is not None
    whole_tensor.install_hooks()
    whole_tensor.register_whole_tensor_optimizer(_Declared)
    assert whole_tensor._REGISTRY._hooks is hooks
