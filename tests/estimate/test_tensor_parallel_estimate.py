"""The estimate of a 2-D model (see [Note: estimating tensor parallelism]): a (N/k, k) mesh under the fake
process group, memory per rank of the local shards, and the bytes of each dimension. Checked from first
principles (the plan's collectives of activations) and against real gloo runs on 4 CPU ranks as 2 x 2: the same
training step, the engine's own counts for the data-parallel group, the same dispatch-mode count for DTensor's
collectives, and the same storage tracker for memory."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import flatshard
from flatshard.engine import gathered_buffers, group_traffic, unit_layouts, unit_states
from flatshard.estimator import EstimateError, StorageTracker, estimate, training_step
from flatshard.estimator.dry_run import itemsize, make_optimizer
from flatshard.estimator.tensor_parallel import TensorParallelTraffic
from flatshard.testing import spawn
from flatshard.testing.llama import LlamaBlock, tensor_parallel_plan, tiny_llama
from tests.estimate.models import gpt
from tests.tp_models import VOCAB, Block, TPLlama, llama_plan

ENV = {"FLATSHARD_SHM": "0"}  # reduce through gloo, as the dry run does


def tp_llama() -> tuple[torch.nn.Module, torch.Tensor]:
    """``tests.tp_models.TPLlama`` and a batch of 2 sequences of 16 tokens (its forward returns logits)."""
    return TPLlama(), torch.arange(32).remainder(VOCAB).view(2, 16)


def sequence_parallel_plan(model: TPLlama, tp_mesh: Any) -> TPLlama:
    return llama_plan(model, tp_mesh, sequence_parallel=True)


FACTORIES = {"tp_llama": (tp_llama, sequence_parallel_plan, Block), "llama": (tiny_llama, None, LlamaBlock)}


def test_tensor_parallel_estimate_counts_each_dimension() -> None:
    """tiny_llama (dim 96, 3 layers, vocabulary 509, batch 2 x 32) on (2, 2) with the module's own plan: the
    parameters are a tensor-parallel half sharded over 2, and DTensor's bytes are the plan's collectives."""
    kwargs: dict[str, Any] = {"device": "cpu", "overhead": 0, "auto_wrap_policy": {LlamaBlock}}
    two_d = estimate(tiny_llama, 4, tensor_parallel_size=2, **kwargs).rows[0]
    one_d = estimate(tiny_llama, 2, **kwargs).rows[0]  # the same 2 data-parallel ranks, whole tensors
    assert two_d.tensor_parallel_size == 2 and set(two_d.comm_by_group) == {"shard", "tensor_parallel"}
    # tensor-parallel rank 0's pieces: half the heads (wq 48 rows, wk and wv 16), half the MLP's 250 features, 255
    # of the 509 vocabulary rows; replicated norms; then sharded over the 2 data-parallel ranks
    block = 48 * 96 + 2 * 16 * 96 + 96 * 48 + 3 * 125 * 96 + 2 * 96
    local = 3 * block + 2 * 255 * 96 + 96
    assert two_d.params == local * 4 // 2 and one_d.params > 1.9 * two_d.params
    assert two_d.optimizer == 2 * two_d.params
    b, s, d, layers, vocab = 2, 32, 96, 3, 509
    hidden = b * s * d * 4
    # forward: the embedding's and each block's wo, w2 partial sums; backward: the gradient of the input of each
    # column-wise linear (wq, wk, wv, w1, w3 per block, the output head); the logits gathered once
    all_reduce = hidden * (1 + 2 * layers) + hidden * (5 * layers + 1)
    assert two_d.tensor_parallel_comm == {
        "all_reduce": all_reduce,
        "all_gather": b * s * (vocab + 1) // 2 * 4,
    }
    assert two_d.comm_by_group["tensor_parallel"] == sum(two_d.tensor_parallel_comm.values())
    assert two_d.activations is not None and one_d.activations is not None
    assert two_d.activations < one_d.activations  # the heads' and the MLP's activations are split


def test_tensor_parallel_size_must_divide_the_world_and_have_a_plan() -> None:
    with pytest.raises(ValueError, match="tensor-parallel size 4 does not divide world size 6"):
        estimate(tiny_llama, "8,6", tensor_parallel_size=4, device="cpu", overhead=0)
    with pytest.raises(EstimateError, match="defines no tensor_parallel_plan.*--tensor-parallel-plan"):
        estimate(gpt, 4, tensor_parallel_size=2, device="cpu", overhead=0)
    with pytest.raises(ValueError, match="plan was given without a tensor-parallel size"):
        estimate(tiny_llama, 4, tensor_parallel_plan=tensor_parallel_plan, device="cpu", overhead=0)
    with pytest.raises(ValueError, match="'muon' with tensor parallelism"):
        estimate(tiny_llama, 4, tensor_parallel_size=2, optimizer="muon", device="cpu", overhead=0)
    with pytest.raises(EstimateError, match="does not divide the model's 6 attention heads"):
        estimate(tiny_llama, 4, tensor_parallel_size=4, device="cpu", overhead=0)


def _real(rank: int, world: int, model: str) -> dict[str, Any]:
    """One 2 x 2 rank: the factory's model on CPU, the plan, shard() over the data-parallel dimension, two
    training steps as the dry run runs them; the second one counted and measured."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    torch.manual_seed(0)
    factory, plan, unit = FACTORIES[model]
    module, batch = factory()
    reference = None
    if model == "llama":  # the plan's numerics: the loss of the unsharded model on the same batch
        import copy

        reference = copy.deepcopy(module)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    (plan or tensor_parallel_plan)(module, mesh["tensor_parallel"])
    flatshard.shard(module, device=torch.device("cpu"), device_mesh=mesh, auto_wrap_policy={unit})
    for transport in {h.transport for s in unit_states(module) for h in s.handles}:
        transport.blocks.capacity = 0  # freed blocks go back at once, as in the dry run
    layouts = unit_layouts(module)
    opt, _, _ = make_optimizer("adamw", module, layouts)
    first = training_step(module, batch, opt)  # records the order, makes the optimizer state
    tracker = StorageTracker()
    tracker.watch([*module.parameters(), *module.buffers(), *(p.grad for p in module.parameters())])
    assert opt is not None
    tracker.watch([v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)])
    tracker.watch_resizable(gathered_buffers(module))
    shard_group = next(h.shard_group for s in unit_states(module) for h in s.handles)
    before = dict(group_traffic(shard_group)[1])
    traffic = TensorParallelTraffic()
    with tracker, traffic:
        tracker.reset_peak()
        training_step(module, batch, opt)
    sent = group_traffic(shard_group)[1]
    out: dict[str, Any] = {
        "params": sum(L.shard_numel * itemsize(L.param_dtype) for L in layouts),
        "peak": tracker.peak,
        "gathered": tracker.resizable_peak,
        "shard": {k: int(v - before.get(k, 0)) for k, v in sent.items() if v - before.get(k, 0)},
        "tensor_parallel": traffic.of(mesh["tensor_parallel"].get_group(0)),
    }
    if reference is not None:
        mean = first.detach().clone()
        dist.all_reduce(mean)  # the 4 ranks of the two data-parallel replicas saw the same batch
        out["loss"] = (mean.item() / world, reference(*batch).item())
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", list(FACTORIES))
def test_tensor_parallel_estimate_matches_a_real_run(model: str) -> None:
    factory, plan, unit = FACTORIES[model]
    row = estimate(
        factory,
        4,
        tensor_parallel_size=2,
        tensor_parallel_plan=plan,
        device="cpu",
        overhead=0,
        auto_wrap_policy={unit},
    ).rows[0]
    ranks = spawn(_real, 4, model, env=ENV)
    assert ranks[0]["params"] == row.params  # rank 0 holds the larger tensor-parallel piece of an odd size
    worst = max(r["peak"] for r in ranks)
    assert abs(row.peak - worst) <= 0.10 * worst, (row.peak, [r["peak"] for r in ranks])
    assert row.gathered == max(r["gathered"] for r in ranks)
    by_group = {role: sum(ranks[0][role].values()) for role in ("shard", "tensor_parallel")}
    assert by_group == row.comm_by_group, (by_group, row.comm_by_group)
    assert ranks[0]["shard"] == row.comm and ranks[0]["tensor_parallel"] == row.tensor_parallel_comm
    if model == "tp_llama":  # even sizes: every rank sends the same
        assert all(r["shard"] == ranks[0]["shard"] for r in ranks)
        assert all(r["tensor_parallel"] == row.tensor_parallel_comm for r in ranks)
        # sequence parallelism: all-gathers and reduce-scatters of the sequence-sharded hidden state
        assert set(row.tensor_parallel_comm) >= {"all_gather", "reduce_scatter"}
    else:
        mine, ref = ranks[0]["loss"]
        assert mine == pytest.approx(ref, rel=1e-5)
