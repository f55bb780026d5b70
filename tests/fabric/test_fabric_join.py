"""``flatshard.join`` around a Fabric evaluation loop whose ranks run different numbers of batches: the loop
completes, each rank's outputs equal the unsharded model's, and the ranks meet at the next reduction."""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.fabric import Fabric

import flatshard
from flatshard.testing import spawn
from flatshard.testing.models import TinyGPT, make_batch

pytestmark = pytest.mark.slow

COUNTS = (3, 1)


def _run(rank: int, world: int) -> dict[str, object]:
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=world, strategy="flatshard")
    fabric.launch()
    torch.manual_seed(0)
    reference = TinyGPT()
    model = fabric.setup(copy.deepcopy(reference))
    batches = [make_batch(50 + 10 * rank + i, 2)[0] for i in range(COUNTS[rank])]
    with torch.no_grad(), flatshard.join(model):  # Fabric's wrapper of the sharded model
        outputs = [model(b) for b in batches]
    total = fabric.all_reduce(torch.tensor(float(len(batches))), reduce_op="sum")
    with torch.no_grad():
        same = all(torch.allclose(o, reference(b), atol=1e-5) for o, b in zip(outputs, batches))
    return {"same": same, "total": float(total)}


def test_join_around_a_fabric_loop() -> None:
    for rank, r in enumerate(spawn(_run, 2)):
        assert r == {"same": True, "total": float(sum(COUNTS))}, (rank, r)
