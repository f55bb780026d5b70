"""Memory: under FULL_SHARD each rank holds about 1/N of the parameters, gradients and AdamW state.

Sizes are measured on the tensors themselves (unique storages), not on process memory: for ``U`` units, each
unit's flat parameter is padded to a multiple of ``N``, so a rank holds between ``full / N`` and
``full / N + U`` elements (``ceil`` adds less than one element per unit).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback

import flatshard
from flatshard.engine import unit_states
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT

from .lit_common import LitGPT, make_loader, make_trainer

pytestmark = pytest.mark.slow

ELEMENT = 4  # float32 bytes
FULL_NUMEL = sum(p.numel() for p in TinyGPT().parameters())  # tied weight counted once
POLICIES = {"one_unit": None, "block_units": {Block}}


def _unique_storage_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _gathered_bytes(model: torch.nn.Module) -> int:
    """Storage still held by the units' gathered (unsharded) flat parameters."""
    return sum(h.flat.untyped_storage().nbytes() for s in unit_states(model) for h in s.handles)


class Probe(Callback):
    def __init__(self) -> None:
        self.seen: dict[str, Any] = {"grad_bytes": [], "gathered_after_step": []}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.seen["param_bytes_at_start"] = _unique_storage_bytes(list(pl_module.parameters()))

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        grads = [p.grad for p in pl_module.parameters()]
        assert all(g is not None for g in grads)
        self.seen["grad_bytes"].append(_unique_storage_bytes(grads))
        self.seen["grad_numel"] = sum(g.numel() for g in grads)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.seen["gathered_after_step"].append(_gathered_bytes(pl_module))


def _measure(rank: int, world: int) -> dict[str, Any]:
    results = {}
    for name, policy in POLICIES.items():
        model, probe = LitGPT(), Probe()
        strategy = flatshard.FlatShardStrategy(auto_wrap_policy=policy)
        trainer = make_trainer(world, strategy, max_steps=2, callbacks=[probe])
        trainer.fit(model, make_loader(2, 2 * world, world))
        optimizer = trainer.optimizers[0]
        params = list(model.parameters())
        states = [optimizer.state[p] for p in params]
        results[name] = {
            **probe.seen,
            "units": len(unit_states(model)),
            "param_bytes_after_fit": _unique_storage_bytes(params),
            "param_numel": sum(p.numel() for p in params),
            "state_numel": {k: sum(s[k].numel() for s in states) for k in ("exp_avg", "exp_avg_sq")},
            "state_bytes": {
                k: _unique_storage_bytes([s[k] for s in states if s[k].numel()])
                for k in ("exp_avg", "exp_avg_sq")
            },
            "state_shapes_match": all(
                s[k].shape == p.shape for s, p in zip(states, params) for k in ("exp_avg", "exp_avg_sq")
            ),
            "gathered_after_fit": _gathered_bytes(model),
        }
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_holds_a_shard_of_params_grads_and_optimizer_state(world: int) -> None:
    ranks = spawn(_measure, world)
    full_bytes = FULL_NUMEL * ELEMENT
    for name in POLICIES:
        per_rank = [r[name] for r in ranks]
        units = per_rank[0]["units"]
        assert units == (1 if name == "one_unit" else 4)
        low, high = full_bytes / world, full_bytes / world + units * ELEMENT
        for rank, info in enumerate(per_rank):
            where = f"{name}, rank {rank} of {world}"
            sizes = {
                "parameter storage after setup": info["param_bytes_at_start"],
                "parameter storage after fit": info["param_bytes_after_fit"],
                **{f"gradient storage at step {i}": v for i, v in enumerate(info["grad_bytes"])},
            }
            assert len(info["grad_bytes"]) == 2, where
            for what, value in sizes.items():
                assert low <= value <= high, f"{where}: {what} = {value} bytes, expected in [{low}, {high}]"
            for key in ("exp_avg", "exp_avg_sq"):
                # The last rank(s) hold the padding, which has no optimizer state: no lower bound per rank.
                value = info["state_bytes"][key]
                assert value <= high, f"{where}: AdamW {key} storage = {value} bytes, expected <= {high}"
                assert info["state_numel"][key] == info["param_numel"], (where, key)
            assert info["state_shapes_match"], where
            # Gathered flat parameters are freed between steps and after training.
            assert info["gathered_after_step"] == [0, 0], where
            assert info["gathered_after_fit"] == 0, where
        # Together the ranks hold every element exactly once (padding excluded).
        assert sum(r["param_numel"] for r in per_rank) == FULL_NUMEL
        assert sum(r["grad_numel"] for r in per_rank) == FULL_NUMEL
        for key in ("exp_avg", "exp_avg_sq"):
            assert sum(r["state_numel"][key] for r in per_rank) == FULL_NUMEL
