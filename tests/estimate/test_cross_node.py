"""The estimate's bytes per process group and between nodes (see [Note: bytes between nodes]) against real gloo
runs on 4 CPU ranks as 2 "nodes" of 2: hybrid accumulation (4 micro-batches, one reduction across replicas per
step) and FULL_SHARD with ``reshard_after_forward=2`` (backward gathers inside the node), counted per group by
the engine, exactly."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import flatshard
from flatshard.engine import group_traffic, unit_layouts, unit_states
from flatshard.estimator import estimate
from flatshard.estimator.dry_run import make_optimizer
from flatshard.estimator.target import call, loss_of
from flatshard.testing import spawn
from flatshard.testing.models import Block
from tests.estimate.models import gpt

ENV = {"FLATSHARD_SHM": "0"}  # reduce through gloo, as the dry run does
MICRO = 4
CASES = {
    "hybrid_accumulation": ({"sharding_strategy": "HYBRID_SHARD", "shard_group_size": 2}, MICRO),
    "node_local_copy": ({"reshard_after_forward": 2}, 1),
}


def _roles(module: torch.nn.Module) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for state in unit_states(module):
        for h in state.handles:
            if h.shard_world > 1:
                out["shard"] = h.shard_group
            if h.replicate_world > 1:
                out["replicate"] = h.replicate_group
        if state.node_group is not None:
            out["node"] = state.node_group
    return out


def _step(module: torch.nn.Module, batch: Any, opt: torch.optim.Optimizer, micro: int) -> None:
    opt.zero_grad(set_to_none=True)
    for m in range(micro):
        with flatshard.no_sync(module, enabled=m < micro - 1):
            loss_of(call(module, batch)).backward()
    opt.step()


def _real(rank: int, world: int, options: dict[str, Any], micro: int) -> dict[str, dict[str, int]]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module, batch = gpt()
    flatshard.shard(module, device=torch.device("cpu"), auto_wrap_policy={Block}, **options)
    opt, _, _ = make_optimizer("adamw", module, unit_layouts(module))
    assert opt is not None
    _step(module, batch, opt, micro)  # records the order, as the dry run's first step
    roles = _roles(module)
    before = {role: dict(group_traffic(g)[1]) for role, g in roles.items()}
    _step(module, batch, opt, micro)
    out = {}
    for role, g in roles.items():
        sent = group_traffic(g)[1]
        out[role] = {
            k: int(v - before[role].get(k, 0)) for k, v in sent.items() if v - before[role].get(k, 0)
        }
    return out


def _wire(kinds: dict[str, int], w: int) -> float:
    """What a rank puts on a ring's links (see [Note: bytes between nodes])."""
    return (
        kinds.get("all_gather", 0) * (w - 1)
        + kinds.get("reduce_scatter", 0) * (w - 1) / w
        + kinds.get("all_reduce", 0) * 2 * (w - 1) / w
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_bytes_per_group_and_between_nodes_match_a_real_run(case: str) -> None:
    options, micro = CASES[case]
    group = options.get("shard_group_size")
    shard_options = {k: v for k, v in options.items() if k != "shard_group_size"}
    row = estimate(
        gpt,
        4,
        device="cpu",
        overhead=0,
        auto_wrap_policy={Block},
        shard_group_size=group,
        micro_batches=micro,
        ranks_per_node=2,
        **shard_options,
    ).rows[0]
    for rank, counted in enumerate(spawn(_real, 4, options, micro, env=ENV)):
        expected = {
            role: nbytes * (1 if role == "replicate" else micro) for role, nbytes in row.comm_by_group.items()
        }
        totals = {role: sum(kinds.values()) for role, kinds in counted.items()}
        assert totals == expected, (rank, totals, expected)
        # the groups that span the two nodes: the replicate group (2 ranks), or FULL_SHARD's group of all 4
        crossing = "replicate" if "replicate" in counted else "shard"
        if rank == 0:
            width = 2 if crossing == "replicate" else 4  # counted over the whole optimizer step already
            assert row.cross_node == int(_wire(counted[crossing], width)), (row.cross_node, counted)
    if case == "node_local_copy":
        assert row.comm_by_group["node"] > 0
