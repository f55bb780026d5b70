"""``import flatshard`` registers the strategy names without importing Lightning, in either import order."""

from __future__ import annotations

import subprocess
import sys

import pytest

_CHECK = """
import sys
{imports}
import lightning.pytorch as pl
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

for name in ("flatshard", "flatshard_grad_op", "flatshard_hybrid", "flatshard_offload"):
    assert name in StrategyRegistry and name in STRATEGY_REGISTRY, name
trainer = pl.Trainer(strategy="flatshard_grad_op", accelerator="cpu", devices=1, logger=False)
assert type(trainer.strategy) is flatshard.FlatShardStrategy, type(trainer.strategy)
assert str(trainer.strategy.sharding_strategy.name) == "SHARD_GRAD_OP", trainer.strategy.sharding_strategy
fabric = Fabric(strategy="flatshard", accelerator="cpu", devices=1)
assert type(fabric.strategy) is flatshard.FlatShardFabricStrategy, type(fabric.strategy)
print("ok")
"""

FLATSHARD_FIRST = """
import flatshard
assert "lightning" not in sys.modules and "lightning.pytorch" not in sys.modules, "import flatshard imported Lightning"
"""

LIGHTNING_FIRST = """
import lightning.pytorch, lightning.fabric
import flatshard
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "imports",
    [FLATSHARD_FIRST, LIGHTNING_FIRST],
    ids=["flatshard_first", "lightning_first"],
)
def test_names_resolve_in_the_trainer_and_fabric(imports: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHECK.format(imports=imports)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_unknown_attribute_is_an_attribute_error() -> None:
    import flatshard

    with pytest.raises(AttributeError, match="no attribute 'FlatShardStrateg'"):
        flatshard.FlatShardStrateg  # noqa: B018
