"""torch.compile on a sharded model (plain PyTorch): every way of compiling trains like the eager, unsharded
reference, without a graph break or a dynamo warning, and compiles nothing new after the second step.

One spawn of 2 ranks runs every case in turn (dynamo is reset between them). Compiling uses the
``aot_eager`` backend: the same dynamo graphs and AOTAutograd forward / backward split as inductor, without
its C++ compile time; one more test runs inductor itself on one case. See [Note: torch.compile].
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

import flatshard
from flatshard.engine import compile_units
from flatshard.testing import spawn
from flatshard.testing.dynamo import watch_dynamo
from flatshard.testing.models import Block, TinyGPT, make_batch

pytestmark = pytest.mark.slow

PER_RANK = 2
STEPS = 4
BACKEND = "aot_eager"

# name -> (sharding strategy, how the model is compiled, activation checkpointing of the blocks)
CASES: dict[str, tuple[str, str, bool]] = {
    "units/FULL_SHARD": ("FULL_SHARD", "compile_units", False),
    "units/SHARD_GRAD_OP": ("SHARD_GRAD_OP", "compile_units", False),
    "torch.compile(model)": ("FULL_SHARD", "torch.compile", False),
    "model.compile()": ("FULL_SHARD", "model.compile", False),
    "block.compile() before shard": ("FULL_SHARD", "block.compile", False),
    "units/checkpointed": ("FULL_SHARD", "compile_units", True),
    "block.compile() before shard/checkpointed": ("FULL_SHARD", "block.compile", True),
    "block.compile() after shard/checkpointed": ("FULL_SHARD", "block.compile after", True),
}


def _build(
    strategy: str, how: str, checkpointed: bool, backend: str
) -> tuple[TinyGPT, TinyGPT, torch.nn.Module]:
    """The reference, the sharded model, and what the training loop calls (the model or its wrapper)."""
    torch.manual_seed(0)
    reference = TinyGPT()
    model = copy.deepcopy(reference)
    if how == "block.compile":
        for blk in model.blocks:
            blk.compile(backend=backend)
    flatshard.shard(
        model,
        auto_wrap_policy={Block},
        sharding_strategy=strategy,
        activation_checkpointing_policy={Block} if checkpointed else None,
    )
    if how == "compile_units":
        assert compile_units(model, {"backend": backend}) == list(model.blocks)
    elif how == "model.compile":
        model.compile(backend=backend)
    elif how == "block.compile after":
        for blk in model.blocks:
            blk.compile(backend=backend)
    elif how == "torch.compile":
        return reference, model, torch.compile(model, backend=backend)
    return reference, model, model


def _run_case(
    rank: int, world: int, strategy: str, how: str, checkpointed: bool, backend: str = BACKEND
) -> dict[str, Any]:
    with watch_dynamo() as watch:
        reference, model, call = _build(strategy, how, checkpointed, backend)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        loss_diff = 0.0
        for step in range(STEPS):
            idx, tgt = make_batch(step, PER_RANK * world)
            ref_loss = reference.loss(idx, tgt)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            logits = call(idx[mine])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt[mine].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            loss_diff = max(loss_diff, abs(mean.item() / world - ref_loss.item()))
            watch.step()
        # Evaluation compiles one more graph per distinct unit (its inputs do not require grad), then nothing.
        with torch.no_grad():
            eval_diff = max((call(idx[mine]) - reference(idx[mine])).abs().max().item() for _ in range(2))
        watch.step()
        full, _ = flatshard.get_state_dict(model, rank0_only=False)
        expected = reference.state_dict()
        weight_diff = max(
            (full[k] - v).abs().max().item() for k, v in expected.items() if v.is_floating_point()
        )
    return {"loss": loss_diff, "weights": weight_diff, "eval": eval_diff, **watch.summary()}


def _run_all(rank: int, world: int) -> dict[str, dict[str, Any]]:
    return {name: _run_case(rank, world, *case) for name, case in CASES.items()}


@pytest.mark.timeout(600)
def test_compiled_training_matches_eager_reference() -> None:
    for rank, results in enumerate(spawn(_run_all, 2)):
        assert sorted(results) == sorted(CASES)
        for name, r in results.items():
            where = f"rank {rank} {name}: {r}"
            assert r["loss"] < 1e-5 and r["weights"] < 1e-5 and r["eval"] < 1e-5, where
            assert r["breaks"] == {}, where  # nothing in flatshard's hooks was traced
            assert r["warnings"] == [], where
            graphs = r["graphs"]
            # The blocks share one graph: compiled at the first step, reused by every block and step.
            assert r["calls_captured"] > 0 and graphs[0] == graphs[STEPS - 1] == 1, where
            assert graphs[STEPS] == 2, where  # the no-grad graph, compiled once for both eval forwards


@pytest.mark.timeout(300)
def test_inductor_compiled_training_matches_eager_reference() -> None:
    """The default backend (inductor: C++ kernels generated and built on CPU) once, on FULL_SHARD: 30 s on 2
    cores with an empty inductor cache."""
    for rank, r in enumerate(spawn(_run_case, 2, "FULL_SHARD", "compile_units", False, "inductor")):
        where = f"rank {rank}: {r}"
        assert r["loss"] < 1e-5 and r["weights"] < 1e-5 and r["eval"] < 1e-5, where
        assert r["breaks"] == {} and r["warnings"] == [], where
        assert r["graphs"] == [1] * STEPS + [2], where
