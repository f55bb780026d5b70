"""The estimate against real runs: gloo ranks on CPU run the same training step, measured by the same storage
tracker (see [Note: what the memory tracker measures]); the per-rank peak must be predicted within 10% and
the bytes of every collective kind exactly, as the engine's own ``comm_stats`` counts them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import flatshard
from flatshard.engine import comm_stats, gathered_buffers, unit_layouts, unit_states
from flatshard.estimator import StorageTracker, estimate, training_step
from flatshard.estimator.dry_run import make_optimizer
from flatshard.testing import spawn
from flatshard.testing.llama import LlamaBlock, tiny_llama
from flatshard.testing.models import Block
from tests.estimate.models import gpt, gpt_large_vocab

# Each real rank reduces through gloo, as the meta dry run reduces (no shared-memory pieces), and keeps no freed
# block for the next gather (see _real_step).
ENV = {"FLATSHARD_SHM": "0"}

FACTORIES = {"gpt": gpt, "llama": tiny_llama, "large": gpt_large_vocab}
WRAP = {"gpt": {Block}, "llama": {LlamaBlock}, "large": {Block}}

# Each case is a real run; the quick tier keeps the 2-rank default, the rest of the matrix is slow.
CASES = [
    pytest.param("gpt", 1, "adamw", {}, marks=pytest.mark.slow),
    ("gpt", 2, "adamw", {}),
    pytest.param("gpt", 2, "adamw", {"checkpoint": True}, marks=pytest.mark.slow),
    pytest.param("gpt", 2, "sgd-momentum", {"sharding_strategy": "SHARD_GRAD_OP"}, marks=pytest.mark.slow),
    pytest.param("gpt", 2, "adamw", {"sharding_strategy": "NO_SHARD"}, marks=pytest.mark.slow),
    pytest.param(
        "gpt",
        4,
        "adamw",
        {"sharding_strategy": "HYBRID_SHARD", "shard_group_size": 2},
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "llama",
        3,
        "adamw",
        {"checkpoint": True, "mixed_precision": {"param_dtype": "bf16"}},
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "llama",
        2,
        "sgd",
        {"sharding_strategy": "HYBRID_SHARD_ZERO2", "shard_group_size": 2},
        marks=pytest.mark.slow,
    ),
    pytest.param("large", 2, "adamw", {"checkpoint": True}, marks=pytest.mark.slow),
    pytest.param(  # selective checkpointing runs in the dry run as in training: kept outputs counted
        "llama",
        2,
        "adamw",
        {"checkpoint": True, "activation_checkpointing_mode": "selective"},
        marks=pytest.mark.slow,
    ),
]


def _options(model: str, case: dict[str, Any]) -> dict[str, Any]:
    options = {k: v for k, v in case.items() if k != "checkpoint"}
    options["auto_wrap_policy"] = WRAP[model]
    if case.get("checkpoint"):
        options["activation_checkpointing_policy"] = WRAP[model]
    return options


def _real_step(rank: int, world: int, model: str, optimizer: str, case: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module, batch = FACTORIES[model]()
    flatshard.shard(module, device=torch.device("cpu"), **_options(model, case))
    for transport in {h.transport for s in unit_states(module) for h in s.handles}:
        transport.blocks.capacity = 0  # freed blocks go back at once, as in the dry run
    opt, _, _ = make_optimizer(optimizer, module, unit_layouts(module))
    training_step(module, batch, opt)  # records the order, makes the optimizer state, as the dry run does
    tracker = StorageTracker()
    tracker.watch([*module.parameters(), *module.buffers(), *(p.grad for p in module.parameters())])
    if opt is not None:
        tracker.watch([v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)])
    tracker.watch_resizable(gathered_buffers(module))
    comm_stats.clear()
    with tracker:
        tracker.reset_peak()
        training_step(module, batch, opt)
    return {
        "peak": tracker.peak,
        "gathered": tracker.resizable_peak,
        "comm": {k: v for k, v in comm_stats.items() if v},
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("model", "world", "optimizer", "case"), CASES, ids=lambda v: str(v))
def test_estimate_matches_a_real_run(model: str, world: int, optimizer: str, case: dict[str, Any]) -> None:
    options = _options(model, case)
    group = options.pop("shard_group_size", None)
    predicted = estimate(
        FACTORIES[model],
        world,
        device="cpu",
        overhead=0,  # tensor memory, as the tracker measures it (the runtime: test_runtime.py)
        optimizer=optimizer,
        shard_group_size=group,
        **options,
    ).rows[0]
    ranks = spawn(_real_step, world, model, optimizer, case, env=ENV)
    worst = max(r["peak"] for r in ranks)
    assert abs(predicted.peak - worst) <= 0.10 * worst, (predicted.peak, [r["peak"] for r in ranks])
    assert predicted.gathered == max(r["gathered"] for r in ranks)
    for rank, r in enumerate(ranks):
        assert r["comm"] == predicted.comm, (rank, r["comm"], predicted.comm)
    if world > 1 and case.get("sharding_strategy") != "NO_SHARD":
        assert predicted.comm.get("all_gather", 0) > 0 and predicted.comm.get("reduce_scatter", 0) > 0
