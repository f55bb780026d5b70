"""Float8 training with torchao's ``Float8Linear`` under ``shard()`` (see [Note: float8 all-gathers]).

The reference is what torchao computes without sharding: an unsharded copy per rank on the rank's batch, its
gradients averaged over the ranks (DDP), the same optimizer. Float8 matmuls then see the same inputs and the
same weights on both sides, so losses and weights agree exactly (fp32 sums of two gradients aside).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import flatshard
from flatshard.engine.transport import comm
from flatshard.testing import spawn

torchao = pytest.importorskip("torchao.float8")

PER_RANK = 16
STEPS = 3


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim: int = 32, blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.head = nn.Linear(dim, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _config(recipe: str) -> Any:
    from torchao.float8 import Float8LinearConfig

    if recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    if recipe == "tensorwise-no-ag":
        return Float8LinearConfig()
    return Float8LinearConfig.from_recipe_name(recipe)


def _float8_model(recipe: str) -> nn.Module:
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    model = Net()
    convert_to_float8_training(model, config=_config(recipe))
    return model


def _batch(step: int, world: int) -> torch.Tensor:
    return torch.randn(PER_RANK * world, 32, generator=torch.Generator().manual_seed(10 + step))


def ddp_backward(reference: nn.Module, x: torch.Tensor, world: int) -> float:
    """The reference's backward on this rank's batch, its gradients averaged over the ranks (DDP); its loss."""
    loss = reference(x).square().mean()
    loss.backward()
    for p in reference.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    return loss.item()


def _train_beside(
    model: nn.Module, reference: nn.Module, rank: int, world: int, after_step: Any = None
) -> float:
    """``STEPS`` AdamW steps of the sharded model on this rank's batch beside the DDP reference (``after_step``
    called after each); the largest difference of their losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    diff = 0.0
    for step in range(STEPS):
        x = _batch(step, world)[mine]
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = ddp_backward(reference, x, world)
        ref_opt.step()
        ref_opt.zero_grad()
        diff = max(diff, abs(loss.item() - ref_loss))
        if after_step is not None:
            after_step()
    return diff


def _train_pair(rank: int, world: int, recipe: str, options: dict[str, Any]) -> dict[str, Any]:
    model = _float8_model(recipe)
    reference = copy.deepcopy(model)
    flatshard.shard(model, auto_wrap_policy={Block}, **options)
    seen: list[tuple[str, str]] = []
    model.blocks[0].up.register_forward_pre_hook(
        lambda m, _: seen.append((type(m.weight).__name__, str(getattr(m.weight, "_data", m.weight).dtype)))
    )
    comm.comm_stats.clear()
    loss_diff = _train_beside(model, reference, rank, world)
    stats = dict(comm.comm_stats)
    full, _ = flatshard.get_state_dict(model, rank0_only=False)
    expected = reference.state_dict()
    return {
        "loss": loss_diff,
        "weights": max((full[k] - v).abs().max().item() for k, v in expected.items()),
        "dtypes": sorted({f"{k}:{v.dtype}:{type(v).__name__}" for k, v in full.items()}),
        "seen": seen[0],
        "stats": stats,
    }


def _check(results: list[dict[str, Any]], gathered: str, tol: float = 1e-6) -> None:
    for r in results:
        assert r["loss"] <= tol and r["weights"] <= tol, r
        assert r["seen"] == gathered, r["seen"]
        assert all(d.endswith("torch.float32:Tensor") for d in r["dtypes"]), r["dtypes"]


CASES = {
    "full_shard": {},
    "shard_grad_op": {"sharding_strategy": "SHARD_GRAD_OP"},
    "no_shard": {"sharding_strategy": "NO_SHARD"},
    "checkpointed": {"activation_checkpointing_policy": {Block}},
    "selective": {"activation_checkpointing_policy": {Block}, "activation_checkpointing_mode": "selective"},
    "optimizer_offload": {"cpu_offload": "optimizer"},
    "prefetch": {"forward_prefetch": True, "limit_all_gathers": False},
}


def _all_cases(rank: int, world: int) -> dict[str, Any]:
    return {name: _train_pair(rank, world, "tensorwise", opts) for name, opts in CASES.items()}


def test_float8_all_gather_matches_torchao_reference() -> None:
    """Every sharding strategy and lever: the unit's linears see float8 weights gathered in float8, and train
    exactly as torchao's unsharded float8 model under DDP; the state holds fp32 weights."""
    results = spawn(_all_cases, 2)
    for name in CASES:
        _check([r[name] for r in results], ("Float8TrainingTensor", "torch.float8_e4m3fn"))


def _hybrid(rank: int, world: int) -> dict[str, Any]:
    return {
        s: _train_pair(rank, world, "tensorwise", {"sharding_strategy": s, "shard_group_size": 2})
        for s in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
    }


@pytest.mark.slow
def test_float8_hybrid_sharding_matches_reference() -> None:
    """Scales reduce over the shard group only (replicas hold the same shards); 4 ranks, 2 per shard group."""
    results = spawn(_hybrid, 4)
    for s in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
        _check([r[s] for r in results], ("Float8TrainingTensor", "torch.float8_e4m3fn"))


def _recipes(rank: int, world: int) -> dict[str, Any]:
    return {r: _train_pair(rank, world, r, {}) for r in ("rowwise", "tensorwise-no-ag")}


def test_recipes_without_float8_all_gather_gather_high_precision() -> None:
    """Rowwise scaling (no float8 all-gather in torchao) and tensorwise without it: high-precision weights are
    gathered and Float8Linear casts them, as under FSDP2; still exactly the reference."""
    results = spawn(_recipes, 2)
    for recipe in ("rowwise", "tensorwise-no-ag"):
        _check([r[recipe] for r in results], ("Tensor", "torch.float32"))


def _bytes(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for recipe in ("tensorwise", "tensorwise-no-ag"):
        model = _float8_model(recipe)
        flatshard.shard(model, auto_wrap_policy={Block})
        x = _batch(0, world)[rank * PER_RANK : (rank + 1) * PER_RANK]
        model(x)  # one forward: scales, then every unit gathered once
        comm.comm_stats.clear()
        with torch.no_grad():
            model(x)
        out[recipe] = dict(comm.comm_stats)
    return out


def test_float8_gathers_one_byte_per_weight_element_and_one_scale_reduction() -> None:
    """The float8 weights cross the wire as one byte per element (a quarter of fp32's), the norms and biases
    in fp32; all weights' scales come from one all-reduce of one float32 each per forward."""
    results = spawn(_bytes, 2)
    model = Net()
    n_linear = sum(1 for m in model.modules() if isinstance(m, nn.Linear))
    # the root stays gathered between forwards: the blocks are what a second forward gathers
    linear = sum(m.weight.numel() for m in model.blocks.modules() if isinstance(m, nn.Linear))
    other = sum(p.numel() for p in model.blocks.parameters()) - linear
    for r in results:
        hp, f8 = r["tensorwise-no-ag"], r["tensorwise"]
        # each rank sends its shard: half of each block (padding aside, a few elements per unit)
        assert abs(hp["all_gather"] - 4 * (linear + other) / 2) <= 4 * 2 * 3
        assert abs(f8["all_gather"] - (linear + 4 * other) / 2) <= 4 * 2 * 3
        assert f8["all_reduce"] == 4 * n_linear and "all_reduce" not in hp


def test_float8_cpu_offload_says_what_to_use() -> None:
    model = _float8_model("tensorwise")
    with pytest.raises(ValueError, match="cpu_offload='optimizer'"):
        flatshard.shard(model, auto_wrap_policy={Block}, cpu_offload=True)


def test_single_process_float8_checkpoint_loads_into_a_plain_model() -> None:
    """One process: the float8 weights train as torchao's, and the state dict loads into the model without
    float8 (plain nn.Linear) that gives the same outputs as the float8-free reading of those weights."""
    model = _float8_model("tensorwise")
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)  # built before shard(): the same Parameters
    flatshard.shard(model, auto_wrap_policy={Block})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x = _batch(step, 1)
        for m, o in ((model, opt), (reference, optimizer)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    state, _ = flatshard.get_state_dict(model)
    ref_state = reference.state_dict()
    assert state.keys() == ref_state.keys()
    for k, v in ref_state.items():
        assert torch.equal(state[k], v.detach().clone().as_subclass(torch.Tensor)), k
    plain = Net()
    plain.load_state_dict(state)
    assert torch.equal(plain.head.weight, state["head.weight"])


def _built_before(rank: int, world: int) -> float:
    model = _float8_model("tensorwise")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # holds the Parameter objects shard() keeps
    before = [id(p) for p in model.parameters()]
    flatshard.shard(model, auto_wrap_policy={Block})
    assert [id(p) for p in model.parameters()] == before
    x = _batch(0, world)[rank * PER_RANK : (rank + 1) * PER_RANK]
    start = flatshard.get_state_dict(model, rank0_only=False)[0]
    model(x).square().mean().backward()
    opt.step()
    after = flatshard.get_state_dict(model, rank0_only=False)[0]
    return min((after[k] - start[k]).abs().max().item() for k in start if k.endswith("weight"))


def test_optimizer_built_before_shard_still_trains_float8_weights() -> None:
    assert all(moved > 0 for moved in spawn(_built_before, 2))


def _join_uneven(rank: int, world: int) -> list[float]:
    model = _float8_model("tensorwise")
    reference = copy.deepcopy(model)
    flatshard.shard(model, auto_wrap_policy={Block})
    outs = []
    with torch.no_grad(), flatshard.join(model):
        for step in range(1 + rank):  # rank 1 runs one batch more
            x = _batch(step, 1)
            outs.append((model(x) - reference(x)).abs().max().item())
    return outs


def test_float8_evaluation_with_uneven_batches_joins() -> None:
    for outs in spawn(_join_uneven, 2):
        assert outs and max(outs) == 0.0


def _compiled(rank: int, world: int, backend: str) -> dict[str, Any]:
    from flatshard.testing.dynamo import watch_dynamo

    with watch_dynamo() as watch:
        model = _float8_model("tensorwise")
        reference = copy.deepcopy(model)
        flatshard.shard(model, auto_wrap_policy={Block})
        model.compile(backend=backend)  # each block compiles; flatshard's hooks stay outside the graphs
        diff = _train_beside(model, reference, rank, world, watch.step)
    return {"loss": diff, **watch.summary()}


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_float8_units_have_no_graph_breaks(backend: str) -> None:
    """Compiled blocks see the gathered Float8TrainingTensor weights as graph inputs: no graph break, no
    recompilation after the first step, and the same losses as torchao's eager reference."""
    for r in spawn(_compiled, 2, backend):
        assert r["breaks"] == {} and r["warnings"] == [], r
        assert len(set(r["graphs"])) == 1, r["graphs"]
        assert r["loss"] <= 1e-6, r


def _muon(rank: int, world: int) -> dict[str, float]:
    """Muon (a whole-tensor optimizer) on the float8 weights, AdamW on the rest."""

    def optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
        matrices = [p for p in model.parameters() if p.ndim == 2]
        rest = [p for p in model.parameters() if p.ndim != 2]
        return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-2)]

    model = _float8_model("tensorwise")
    reference = copy.deepcopy(model)
    flatshard.shard(model, auto_wrap_policy={Block})
    with flatshard.original_shapes(model):  # Muon checks p.ndim == 2 when it is built
        opts = optimizers(model)
    ref_opts = optimizers(reference)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    diff = 0.0
    for step in range(STEPS):
        x = _batch(step, world)[mine]
        loss = model(x).square().mean()
        loss.backward()
        ref_loss = ddp_backward(reference, x, world)
        for o in (*opts, *ref_opts):
            o.step()
            o.zero_grad()
        diff = max(diff, abs(loss.item() - ref_loss))
    full, _ = flatshard.get_state_dict(model, rank0_only=False)
    return {
        "loss": diff,
        "weights": max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items()),
    }


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon (torch >= 2.9)")
def test_float8_with_a_whole_tensor_optimizer() -> None:
    for r in spawn(_muon, 2):
        assert r["loss"] <= 1e-6 and r["weights"] <= 1e-5, r


def _meta_built(rank: int, world: int) -> dict[str, Any]:
    """Built and converted on the meta device, then sharded (each rank materializes its units' shards); loaded
    with the CPU-built model's weights, it computes exactly what that model computes."""
    from torchao.float8 import convert_to_float8_training

    with torch.device("meta"):
        model = Net()
    convert_to_float8_training(model, config=_config("tensorwise"))
    flatshard.shard(model, auto_wrap_policy={Block}, device=torch.device("cpu"))
    reference = _float8_model("tensorwise")
    flatshard.set_state_dict(
        model,
        None,
        {k: v.detach().as_subclass(torch.Tensor) for k, v in reference.state_dict().items()},
        None,
    )
    x = _batch(0, world)[rank * PER_RANK : (rank + 1) * PER_RANK]
    return {"diff": (model(x) - reference(x)).abs().max().item()}


def test_float8_model_built_on_the_meta_device() -> None:
    for r in spawn(_meta_built, 2):
        assert r["diff"] == 0.0, r
