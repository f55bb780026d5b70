"""The estimator without processes: layout arithmetic, option handling, errors, the command line. On ``cpu`` these
pass ``overhead=0`` (tensor memory only), so no runtime is measured (that is ``test_runtime.py``'s)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from flatshard.cli import main
from flatshard.engine import whole_tensor_owners
from flatshard.estimator import EstimateError, StorageTracker, estimate
from flatshard.testing.llama import LlamaBlock, tiny_llama
from flatshard.testing.models import Block
from tests.estimate.models import gpt, gpt_without_batch

WRAP = {Block}


def _row(factory=gpt, world=2, **kw):
    return estimate(factory, world, device="cpu", overhead=0, auto_wrap_policy=WRAP, **kw).rows[0]


@pytest.mark.parametrize(
    ("world", "options"),
    [
        (2, {}),
        (4, {}),
        (3, {"sharding_strategy": "SHARD_GRAD_OP"}),
        (2, {"sharding_strategy": "NO_SHARD"}),
        (4, {"sharding_strategy": "HYBRID_SHARD", "shard_group_size": 2}),
        (4, {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}),
        (2, {"reshard_root_after_forward": True}),
        (4, {"reshard_after_forward": 2}),
        (4, {"reshard_after_forward": 2, "mixed_precision": {"param_dtype": "bf16"}, "ranks_per_node": 2}),
        (4, {"sharding_strategy": "HYBRID_SHARD", "shard_group_size": 2, "micro_batches": 4}),
    ],
)
def test_layout_rules_give_the_bytes_the_step_counts(world: int, options: dict) -> None:
    """Without a batch, communication comes from the layout; with one, from comm_stats of the dry step."""
    measured = _row(gpt, world, **options)
    ruled = _row(gpt_without_batch, world, **options)
    assert measured.measured and not ruled.measured
    assert measured.comm == ruled.comm
    assert measured.comm_by_group == ruled.comm_by_group  # per group: counted by the groups, and by the rules
    assert measured.cross_node == ruled.cross_node
    assert (measured.params, measured.grads, measured.optimizer) == (
        ruled.params,
        ruled.grads,
        ruled.optimizer,
    )


def test_shards_shrink_with_ranks() -> None:
    model = gpt_without_batch()  # on CPU: count its parameters
    numel = sum(p.numel() for p in model.parameters())
    units = 5
    rows = estimate(gpt_without_batch, "1,2,4,8", device="cpu", overhead=0, auto_wrap_policy=WRAP).rows
    for r in rows:
        n = r.world_size
        assert numel * 4 / n <= r.params <= (numel + units * n) * 4 / n  # padding: < n elements per unit
        assert r.grads == r.params
        assert r.optimizer == pytest.approx(2 * r.params, rel=0.01)  # AdamW: two fp32 states, no padding
    assert [r.world_size for r in rows] == [1, 2, 4, 8]


def test_optimizer_kinds() -> None:
    adamw, sgd, momentum, none = (_row(optimizer=o) for o in ("adamw", "sgd", "sgd-momentum", "none"))
    assert sgd.optimizer == none.optimizer == 0
    assert momentum.optimizer * 2 == adamw.optimizer
    assert adamw.peak > momentum.peak > sgd.peak
    custom = _row(optimizer="torch.optim.Adagrad")
    assert custom.optimizer == momentum.optimizer  # one state tensor per parameter


def test_muon_momentum_is_whole_on_owners() -> None:
    row = _row(world=4, optimizer="muon")
    model = gpt_without_batch()
    mats = [p for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith(("wte", "wpe"))]
    owners = whole_tensor_owners([p.shape for p in mats], 4)
    owned = [sum(2 * p.numel() * 4 for p, o in zip(mats, owners) if o == r) for r in range(4)]
    others = [p for p in model.parameters() if all(p is not q for q in mats)]
    assert max(owned) < sum(owned)  # shared between ranks
    adamw_part = row.optimizer - max(owned)
    assert 0 < adamw_part <= 2 * sum(p.numel() for p in others) * 4
    assert row.optimizer_exchange > 0
    assert any("Muon on" in n for n in row.notes)


def test_owners_are_balanced() -> None:
    shapes = [torch.Size((64, 64))] * 8 + [torch.Size((128, 32))] * 4
    owners = whole_tensor_owners(shapes, 4)
    assert sorted(owners.count(r) for r in range(4)) == [3, 3, 3, 3]


def test_cuda_adds_allocator_lag_and_overhead() -> None:
    cpu = _row(world=4)
    cuda = estimate(gpt, 4, device="cuda", auto_wrap_policy=WRAP).rows[0]
    assert cuda.overhead == 2**30 and cpu.overhead == 0
    assert cuda.peak == cpu.peak + cuda.allocator_lag + cuda.overhead
    assert 0 < cuda.allocator_lag <= 2 * cpu.gathered
    unlimited = estimate(gpt, 4, auto_wrap_policy=WRAP, limit_all_gathers=False).rows[0]
    assert unlimited.allocator_lag == 2 * cuda.allocator_lag  # four blocks instead of the two largest


def test_activation_checkpointing_and_precision_shrink_activations() -> None:
    full = estimate(tiny_llama, 2, device="cpu", overhead=0, auto_wrap_policy={LlamaBlock}).rows[0]
    ckpt = estimate(
        tiny_llama,
        2,
        device="cpu",
        overhead=0,
        auto_wrap_policy={LlamaBlock},
        activation_checkpointing_policy={LlamaBlock},
    ).rows[0]
    bf16 = estimate(
        tiny_llama,
        2,
        device="cpu",
        overhead=0,
        auto_wrap_policy={LlamaBlock},
        mixed_precision={"param_dtype": "bf16"},
    ).rows[0]
    assert full.activations and ckpt.activations and bf16.activations
    assert ckpt.activations < full.activations / 2
    assert bf16.activations < full.activations
    assert bf16.comm["all_gather"] * 2 == full.comm["all_gather"]


def test_offload_moves_state_to_host() -> None:
    on_device = estimate(gpt, 2, auto_wrap_policy=WRAP).rows[0]
    offloaded = estimate(gpt, 2, auto_wrap_policy=WRAP, cpu_offload=True).rows[0]
    assert offloaded.host == on_device.params + on_device.grads + on_device.optimizer
    assert offloaded.peak < on_device.peak
    assert any("offload" in n for n in offloaded.notes)


def test_exposed_time_follows_the_link() -> None:
    def timed(bandwidth, **kw):
        return estimate(gpt, 4, auto_wrap_policy=WRAP, bandwidth=bandwidth, tflops=1e-3, **kw).rows[0]

    fast, slow = timed("1000GB/s"), timed("1GB/s")
    assert fast.communication_s < slow.communication_s
    for r in (fast, slow):
        assert 0 <= r.exposed_s <= r.communication_s + 1e-12
        assert r.step_s == pytest.approx(r.compute_s + r.exposed_s)
    assert slow.exposed_s > fast.exposed_s
    # Prefetching hides more of a slow link behind compute, never less.
    none = timed("1GB/s", backward_prefetch=None)
    assert slow.exposed_s <= none.exposed_s
    preset = estimate(gpt, 2, auto_wrap_policy=WRAP, bandwidth="infiniband").rows[0]
    assert preset.communication_s and preset.communication_s > 0


def test_storage_tracker_counts_live_bytes() -> None:
    keep = torch.zeros(1000)
    tracker = StorageTracker()
    tracker.watch([keep])
    with tracker:
        tracker.reset_peak()
        a = torch.ones(2000)
        b = a * 2  # 4000 + 8000 + 8000 bytes alive here
        del a
        c = b + 1  # 4000 + 8000 + 8000 again
        del b, c
    assert tracker.peak == 4000 + 8000 + 8000
    assert tracker.live() == 4000


# ------------------------------------------------------------------ errors


def _raises() -> nn.Module:
    raise RuntimeError("config file missing")


def _not_a_module() -> int:
    return 3


def _real_tensors() -> nn.Module:
    return nn.Linear(2, 2, device="cpu")


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        (_raises, "config file missing"),
        (_not_a_module, "returned int, not a module"),
        (_real_tensors, "outside the meta device"),
        ("no_colon_here", "module.path:factory"),
        ("tests.estimate.models:nothing", "has no attribute 'nothing'"),
        ("not_a_package_xyz:f", "importing 'not_a_package_xyz' failed"),
    ],
)
def test_bad_targets_name_the_problem(target, expected: str) -> None:
    with pytest.raises(EstimateError, match="HINT") as info:
        estimate(target, 2)
    assert expected in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"world_size": "8,x"}, "world size 'x'"),
        ({"world_size": 0}, "world size 0"),
        ({"bandwidth": "fast"}, "bandwidth='fast'"),
        ({"bandwidth": "nvlink", "latency": "soon"}, "latency='soon'"),
        ({"optimizer": "lion"}, "optimizer='lion'"),
        ({"device": "tpu"}, "device='tpu'"),
        ({"sharding_strategy": "ZERO4"}, "ZERO4"),
        ({"sharding_strategy": "HYBRID_SHARD", "shard_group_size": 3, "world_size": 8}, "does not divide"),
        ({"shard_group_size": 2}, "only apply to HYBRID"),
        ({"capacity": "lots"}, "capacity='lots'"),
    ],
)
def test_bad_options_get_a_hint(kwargs: dict, expected: str) -> None:
    kwargs = {"world_size": 2, **kwargs}
    with pytest.raises((ValueError, TypeError)) as info:
        estimate(gpt, **kwargs)
    assert expected in str(info.value)
    assert "HINT" in str(info.value)


def test_too_large_says_what_does_not_fit_and_what_would() -> None:
    est = estimate(gpt, "1,2", auto_wrap_policy=WRAP, device="cuda", capacity="3MiB", overhead=0)
    assert all(r.fits is False for r in est.rows)
    message = est.diagnosis()
    assert message is not None and "does not fit" in message and "at 2 ranks" in message
    assert "HINT" in message and "more ranks" in message and "--cpu-offload" in message
    assert "activation checkpointing" in message
    roomy = estimate(gpt, 2, auto_wrap_policy=WRAP, capacity="1GiB", overhead=0)
    assert roomy.diagnosis() is None


def test_refuses_inside_a_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(EstimateError, match="already has one"):
        estimate(gpt, 2)


# ------------------------------------------------------------------ command line


def test_command_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "estimate",
            "tests.estimate.models:gpt",
            "-n",
            "2,4",
            "--wrap",
            "Block",
            "--checkpoint",
            "Block",
            "--mixed-precision",
            "bf16",
            "--bandwidth",
            "nvlink",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    for line in (
        "2 ranks",
        "4 ranks",
        "peak",
        "activations",
        "all-gather",
        "reduce-scatter",
        "exposed communication",
    ):
        assert line in out


def test_command_json_and_hybrid(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "estimate",
            "tests.estimate.models:gpt",
            "-n",
            "4",
            "--strategy",
            "hybrid_shard",
            "--shard-group-size",
            "2",
            "--wrap",
            "tests.estimate.models.Block",
            "--device",
            "cpu",
            "--overhead",
            "0",
            "--json",
        ]
    )
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    (row,) = data["rows"]
    assert row["shard_group_size"] == 2 and row["comm_by_group"]["replicate"] > 0
    assert data["options"]["sharding_strategy"] == "HYBRID_SHARD"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["tests.estimate.models:gpt", "-n", "2", "--bandwidth", "9 parsecs"], "is not a bandwidth"),
        (["tests.estimate.models:gpt", "-n", "2", "--mixed-precision", "bf16,fp32,fp16"], "has 3 dtypes"),
        (["tests.estimate.models:missing", "-n", "2"], "has no attribute"),
        (["tests.estimate.models:gpt", "-n", "2", "--wrap", "Block,a.b.C"], "mixes import paths"),
    ],
)
def test_command_errors(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", *argv]) == 2
    err = capsys.readouterr().err
    assert expected in err and "HINT" in err


def test_command_exits_1_when_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["estimate", "tests.estimate.models:gpt", "-n", "2", "--wrap", "Block", "--gpu-memory", "2MiB"]
    )
    captured = capsys.readouterr()
    assert code == 1
    assert "NO" in captured.out and "does not fit" in captured.err and "HINT" in captured.err


class _ReadsValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > 0:  # a value: there is none on the meta device
            return self.lin(x)
        return self.lin(-x)


def _reads_values() -> tuple[nn.Module, torch.Tensor]:
    return _ReadsValues(), torch.ones(2, 4)


def test_a_step_that_reads_values_is_explained() -> None:
    with pytest.raises(EstimateError, match="failed on the meta device") as info:
        estimate(_reads_values, 2)
    assert "HINT" in str(info.value) and ".item()" in str(info.value)
    row = estimate(lambda: _ReadsValues(), 2).rows[0]  # without a batch: the layout numbers
    assert row.params > 0 and row.activations is None


def test_offload_needs_a_device() -> None:
    with pytest.raises(ValueError, match="nothing to offload to"):
        estimate(gpt, 2, cpu_offload=True, device="cpu")


def test_timing_model_by_hand() -> None:
    from flatshard.estimator.dry_run import Collective
    from flatshard.estimator.options import Link
    from flatshard.estimator.timing import collective_seconds, step_time

    link = Link("test", 1e9, 1e-6)
    assert collective_seconds("all_gather", 1000, 4, link) == pytest.approx(3e-6 + 3e-6)
    assert collective_seconds("reduce_scatter", 4000, 4, link) == pytest.approx(3e-6 + 3e-6)
    assert collective_seconds("all_reduce", 4000, 4, link) == pytest.approx(2 * (3e-6 + 3e-6))
    assert collective_seconds("all_gather", 1000, 1, link) == 0.0
    # 1e6 FLOP at 1 TFLOP/s is 1 us of compute. A 6 us gather issued at the start and needed after 1 us of
    # compute stalls 5 us; a second one issued at 1 us and needed at the end waits for the link (busy until 6 us)
    # and is done at 12 us, while compute ends at 7 us: 5 us more.
    trace = [Collective("all_gather", 1000, 0, 10**6), Collective("all_gather", 1000, 10**6, None)]
    t = step_time(trace, 2 * 10**6, 1e-6 * 1e6, 4, 1, link, link)
    assert t.compute == pytest.approx(2e-6)
    assert t.communication == pytest.approx(12e-6)
    assert t.exposed == pytest.approx(5e-6 + 5e-6)
    assert t.step == pytest.approx(12e-6)


def test_an_estimate_leaves_no_desync_settings_behind(tmp_path: Path) -> None:
    """The fake group's state goes with it: a later process group of the same name starts from the defaults
    (its desync limit is not the estimate's ``None``), even before the estimate's model is collected."""
    import torch.distributed as dist

    from flatshard.engine.transport import watchdog
    from flatshard.engine.transport.groups import state_of

    estimate(gpt, [2], device="cpu", overhead=0)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        state = state_of(None)
        assert not state.limit_set and state.flat_seq == 0
        assert watchdog.group_limit(state) == watchdog.limit() == watchdog.DEFAULT_LIMIT_S
    finally:
        dist.destroy_process_group()
