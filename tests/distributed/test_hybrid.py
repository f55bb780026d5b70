"""Hybrid sharding on 4 gloo ranks as 2 shard groups of 2: parity with the unsharded model, the ways to give
the groups, what crosses the replicate group, validation, and checkpoints that load on other topologies."""

from __future__ import annotations

import copy
import logging
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import flatshard
from flatshard.engine import unit_states
from flatshard.engine.setup.process_groups import hybrid_groups
from flatshard.engine.transport import comm
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

PER_RANK = 2
STEPS = 3


def _groups(how: str) -> dict[str, object]:
    """``size``/``tuple``/``mesh``/``env`` give 2 shard groups of 2; a suffix ``k`` gives groups of ``k``."""
    k = int(re.sub(r"\D", "", how) or 2)
    if how.startswith("size"):
        return {"shard_group_size": k}
    if how.startswith("tuple"):
        return {"process_group": hybrid_groups(k)}
    if how.startswith("mesh"):
        from torch.distributed.device_mesh import init_device_mesh

        shape = (dist.get_world_size() // k, k)
        return {"process_group": init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))}
    os.environ["LOCAL_WORLD_SIZE"] = str(k)  # what a launcher sets: shard within a "node" of k ranks
    return {}


def _train(
    rank: int, world: int, strategy: str, how: str
) -> tuple[float, dict[str, int], torch.nn.Module, object]:
    torch.manual_seed(0)
    reference = TinyGPT()
    model = copy.deepcopy(reference)
    flatshard.shard(model, sharding_strategy=strategy, auto_wrap_policy={Block}, **_groups(how))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    comm.comm_stats.clear()
    for step in range(STEPS):
        idx, tgt = make_batch(step, PER_RANK * world)
        reference.loss(idx, tgt).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        model.loss(idx[mine], tgt[mine]).backward()
        flatshard.clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad()
    stats = dict(comm.comm_stats)
    with flatshard.unshard_params(model):
        worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    return worst, stats, model, opt


def _parity(rank: int, world: int, tmp: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for strategy, how in (
        ("HYBRID_SHARD", "size"),
        ("HYBRID_SHARD_ZERO2", "size"),
        ("HYBRID_SHARD", "tuple"),
        ("HYBRID_SHARD", "mesh"),
        ("HYBRID_SHARD", "env"),
    ):
        worst, stats, model, opt = _train(rank, world, strategy, how)
        handles = [h for s in unit_states(model) for h in s.handles]
        assert all(h.shard_world == 2 and h.replicate_world == 2 for h in handles)
        shard_bytes = sum(h.sharded.numel() * h.sharded.element_size() for h in handles)
        out[f"{strategy}/{how}"] = worst
        # the replicate group carries each gradient shard once per step: half the model per rank
        out[f"{strategy}/{how}/replicate_ratio"] = stats.get("all_reduce", 0) / (STEPS * shard_bytes)
        if how == "size" and strategy == "HYBRID_SHARD":
            full, _ = flatshard.get_state_dict(model, opt)  # rank 0 only
            out["full_keys"] = len(full)
            flatshard.save_checkpoint(os.path.join(tmp, "hybrid"), model, opt, state_dict_type="sharded")
            flatshard.save_checkpoint(os.path.join(tmp, "hybrid.ckpt"), model, opt)
            ref = flatshard.get_state_dict(model, rank0_only=False)[0]
            torch.save(ref, os.path.join(tmp, f"expected_{rank}.pt"))
            # reload into a plain FULL_SHARD model on the same ranks
            fresh = TinyGPT()
            flatshard.shard(fresh, auto_wrap_policy={Block})
            fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
            flatshard.load_checkpoint(os.path.join(tmp, "hybrid"), fresh, fresh_opt)
            again = flatshard.get_state_dict(fresh, rank0_only=False)[0]
            out["reload_full_shard"] = max((again[k] - v).abs().max().item() for k, v in ref.items())
    return out


def _one_node(rank: int, world: int) -> dict[str, object]:
    """Hybrid configs with one group on a side run as FULL_SHARD / SHARD_GRAD_OP / NO_SHARD would."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("flatshard.engine.setup.process_groups")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    out: dict[str, object] = {}
    for strategy, how, shard_world, replicate_world in (
        ("HYBRID_SHARD", "env4", 4, 1),  # one node of 4: the default group size is the node
        ("HYBRID_SHARD_ZERO2", "size4", 4, 1),
        ("HYBRID_SHARD", "mesh4", 4, 1),  # a (1, 4) mesh
        ("HYBRID_SHARD", "size1", 1, 4),
    ):
        worst, _, model, _ = _train(rank, world, strategy, how)
        handles = [h for s in unit_states(model) for h in s.handles]
        out[f"{strategy}/{how}"] = worst
        out[f"{strategy}/{how}/groups"] = all(
            h.shard_world == shard_world and h.replicate_world == replicate_world for h in handles
        )
        out[f"{strategy}/{how}/reshards"] = all(
            (s.strategy.reshard_after_forward == (strategy == "HYBRID_SHARD")) for s in unit_states(model)
        )
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    out["logged"] = records
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hybrid_on_one_node_runs_as_full_shard_or_no_shard() -> None:
    for r in spawn(_one_node, 4):
        logged = r.pop("logged")
        assert any("runs as FULL_SHARD" in m for m in logged), logged
        assert any("runs as SHARD_GRAD_OP" in m for m in logged), logged
        assert any("as under NO_SHARD" in m for m in logged), logged
        assert len(logged) == 3, logged  # once per layout
        for key, value in r.items():
            assert value is True if key.endswith(("/groups", "/reshards")) else value <= 1e-5, (key, r)


def _load_elsewhere(rank: int, world: int, tmp: str, strategy: str) -> float:
    expected = torch.load(os.path.join(tmp, "expected_0.pt"))
    kwargs: dict[str, object] = {"sharding_strategy": strategy}
    if strategy.startswith("HYBRID"):
        kwargs["shard_group_size"] = 2
    results = []
    for name in ("hybrid", "hybrid.ckpt"):
        fresh = TinyGPT()
        flatshard.shard(fresh, auto_wrap_policy={Block}, **kwargs)
        opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        flatshard.load_checkpoint(os.path.join(tmp, name), fresh, opt)
        got = flatshard.get_state_dict(fresh, rank0_only=False)[0]
        results.append(max((got[k] - v).abs().max().item() for k, v in expected.items()))
    dist.barrier()
    return max(results)


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, object]], Path]:
    tmp = tmp_path_factory.mktemp("hybrid")
    return spawn(_parity, 4, str(tmp)), tmp


@pytest.mark.timeout(300)
def test_hybrid_parity_and_replicate_traffic(hybrid_run: tuple[list[dict[str, object]], Path]) -> None:
    results, _ = hybrid_run
    for r in results:
        for key, value in r.items():
            if key.endswith("replicate_ratio"):
                assert value == pytest.approx(1.0), (key, r)
            elif key == "full_keys":
                continue
            else:
                assert value <= 1e-5, (key, r)
    assert results[0]["full_keys"] == len(TinyGPT().state_dict())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hybrid_checkpoints_load_on_other_topologies(
    hybrid_run: tuple[list[dict[str, object]], Path],
) -> None:
    _, tmp = hybrid_run
    for err in spawn(_load_elsewhere, 2, str(tmp), "FULL_SHARD"):
        assert err <= 1e-6
    for err in spawn(_load_elsewhere, 4, str(tmp), "HYBRID_SHARD_ZERO2"):
        assert err <= 1e-6


def _validation(rank: int, world: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, kwargs in (
        ("not_divisible", {"shard_group_size": 3}),
        ("larger_than_world", {"shard_group_size": 8}),
        ("flat_group", {"process_group": dist.group.WORLD}),
        ("non_hybrid_size", {"sharding_strategy": "FULL_SHARD", "shard_group_size": 2}),
    ):
        args = {"sharding_strategy": "HYBRID_SHARD", **kwargs}
        try:
            flatshard.shard(TinyGPT(), **args)  # type: ignore[arg-type]
            out[name] = "no error"
        except ValueError as err:
            out[name] = str(err)
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    try:
        flatshard.shard(TinyGPT(), sharding_strategy="HYBRID_SHARD")
        out["no_local_size"] = "no error"
    except ValueError as err:
        out["no_local_size"] = str(err)
    # sync_module_states: every replica and every shard group starts from rank 0's weights
    torch.manual_seed(rank)
    model = TinyGPT()
    flatshard.shard(model, sharding_strategy="HYBRID_SHARD", shard_group_size=2, sync_module_states=True)
    torch.manual_seed(0)
    expected = TinyGPT().state_dict()
    full = flatshard.get_state_dict(model, rank0_only=False)[0]
    out["synced"] = str(all(torch.equal(full[k], v) for k, v in expected.items()))
    # units with different groups
    model = TinyGPT()
    flatshard.shard(model.blocks[0], sharding_strategy="HYBRID_SHARD", shard_group_size=2)
    try:
        flatshard.shard(model, sharding_strategy="FULL_SHARD")
        out["mixed_groups"] = "no error"
    except ValueError as err:
        out["mixed_groups"] = str(err)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hybrid_validation_and_sync_module_states() -> None:
    results = spawn(_validation, 4)
    assert all(r["synced"] == "True" for r in results), results
    r = results[0]
    assert "does not divide the world size 4" in r["not_divisible"]
    assert "shard_group_size=8 does not divide the world size 4" in r["larger_than_world"]
    assert "(shard_group, replicate_group) tuple" in r["flat_group"]
    assert "only applies to HYBRID_SHARD" in r["non_hybrid_size"]
    assert "LOCAL_WORLD_SIZE" in r["no_local_size"]
    assert "same shard and replicate groups" in r["mixed_groups"]
    assert r["synced"] == "True"
