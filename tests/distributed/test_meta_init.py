"""Meta-device init: models built on ``torch.device("meta")`` are materialized unit by unit by ``shard()``.

Parity needs the same initial values as an eagerly built reference, so the init function here fills each
parameter from a generator seeded by its qualified name; order of materialization does not matter then.
"""

from __future__ import annotations

import copy
import importlib
import resource
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import flatshard
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

PER_RANK = 2


def name_seeded_init(names: dict[nn.Module, str]):  # type: ignore[no-untyped-def]
    """An init function that gives each parameter values determined by its full name only, buffers zeros."""

    def init(module: nn.Module) -> None:
        prefix = names[module]
        for name, p in module.named_parameters(recurse=False):
            g = torch.Generator().manual_seed(zlib.crc32(f"{prefix}.{name}".encode()))
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        for b in module.buffers(recurse=False):
            b.zero_()

    return init


def _init_eager(model: nn.Module) -> None:
    names = {m: n for n, m in model.named_modules()}
    init = name_seeded_init(names)
    with torch.no_grad():
        for m in model.modules():
            init(m)
        # The tied head/embedding weight was written twice; its first holder (wte) wins, as in shard().
        if isinstance(model, TinyGPT):
            init(model.wte)


def _counting(model: nn.Module, init, seen: list[int]):  # type: ignore[no-untyped-def]
    """``init`` that first records how many parameter elements are materialized (shards and full tensors)."""

    def counting_init(module: nn.Module) -> None:
        seen.append(sum(p.numel() for p in model.parameters() if not p.is_meta))
        init(module)

    return counting_init


def _parity(rank: int, world: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        reference = TinyGPT()
        _init_eager(reference)
        with torch.device("meta"):
            model = TinyGPT()
        names = {m: n for n, m in model.named_modules()}
        seen: list[int] = []
        counting_init = _counting(model, name_seeded_init(names), seen)
        flatshard.shard(
            model, sharding_strategy=strategy, auto_wrap_policy={Block}, param_init_fn=counting_init
        )
        assert model.head.weight is model.wte.weight, "tied parameters must stay tied after materialization"
        assert model.steps.device.type == "cpu" and int(model.steps) == 0
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        with flatshard.unshard_params(model):
            out[f"{strategy}/init"] = max(
                (a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters())
            )
        for step in range(3):
            idx, tgt = make_batch(step, PER_RANK * world)
            reference.loss(idx, tgt).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            model.loss(idx[mine], tgt[mine]).backward()
            opt.step()
            opt.zero_grad()
        with flatshard.unshard_params(model):
            out[strategy] = max(
                (a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters())
            )
        if strategy == "FULL_SHARD":
            # Materialized parameters alive at any init call: shards done so far + the current unit in full.
            full = sum(p.numel() for p in reference.parameters())
            largest = max(sum(p.numel() for p in b.parameters()) for b in reference.blocks)
            root = full - largest * len(reference.blocks)
            out["peak_numel_ratio"] = max(seen) / (full / world + max(largest, root))
    return out


def _reset_parameters_and_sync(rank: int, world: int) -> dict[str, object]:
    """Default init (reset_parameters) gives every rank the same values; sync_module_states broadcasts rank 0's."""
    torch.manual_seed(rank)  # different random streams on the two ranks
    with torch.device("meta"):
        model = TinyGPT()
    flatshard.shard(model, auto_wrap_policy={Block}, sync_module_states=True)
    full, _ = flatshard.get_state_dict(model, rank0_only=False)
    gathered: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    torch.distributed.all_gather_object(gathered, full)
    same = all(torch.equal(gathered[0][k], gathered[1][k]) for k in full)
    std = float(full["blocks.0.fc.weight"].std())
    return {
        "same": same,
        "std": std,
        "finite": all(bool(torch.isfinite(v.float()).all()) for v in full.values()),
    }


def _big_model_peak(rank: int, world: int) -> dict[str, float]:
    """A model of 16 x 16 MiB linears on the meta device: peak RSS grows by about half the model, not all."""
    layers = 16
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(layers)])
    model_bytes = layers * 2048 * 2048 * 4
    # shard() imports dynamo to keep its hooks out of compiled graphs (26 MiB, once per process): import it first,
    # so that only what sharding holds of the model is measured.
    importlib.import_module("torch._dynamo")

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    flatshard.shard(model, auto_wrap_policy={nn.Linear})
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    local = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"growth": (after - before) / model_bytes, "local": local / model_bytes}


@pytest.mark.timeout(300)
def test_meta_init_parity_and_peak() -> None:
    for r in spawn(_parity, 2):
        for key, value in r.items():
            if key == "peak_numel_ratio":
                assert value <= 1.0, r
            else:
                assert value <= 1e-5, (key, r)


@pytest.mark.timeout(300)
def test_meta_init_default_reset_and_sync() -> None:
    for r in spawn(_reset_parameters_and_sync, 2):
        assert r["same"] and r["finite"], r
        assert 0.01 < r["std"] < 1.0, r  # initialized, not zeros or garbage


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_meta_init_never_holds_the_whole_model() -> None:
    for r in spawn(_big_model_peak, 2):
        assert abs(r["local"] - 0.5) < 1e-6, r
        assert r["growth"] < 0.75, (
            f"peak RSS grew by {r['growth']:.2f}x the model (whole model would be >= 1.0)"
        )


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class _Scaled(nn.Module):
    """A module with a buffer that nothing initializes (no reset_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def test_meta_tensors_nothing_initialized_are_refused_by_name() -> None:
    """No reset_parameters, no param_init_fn value, nothing loaded: an error naming the tensor at the first
    forward and at a save, never zeros or garbage; a load (or a value written) fills it."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), _NoReset(), _Scaled())
    flatshard.shard(model)  # accepted: the values may come from a checkpoint
    x = torch.ones(1, 3)
    for _ in range(2):  # refused each time, and the hooks stay usable
        with pytest.raises(flatshard.UnfilledError, match=r"'1\.w'.*'2\.scale'.*load_pretrained"):
            model(x)
    with pytest.raises(flatshard.UnfilledError, match=r"'1\.w'"):
        flatshard.get_state_dict(model)
    model.load_state_dict({"1.w": torch.full((3,), 2.0)}, strict=False)  # the parameter: filled by the load
    with pytest.raises(flatshard.UnfilledError, match=r"2 tensor|1 tensor") as err:
        model(x)
    assert "'1.w'" not in str(err.value) and "'2.scale'" in str(err.value)
    with torch.no_grad():
        model[2].scale.fill_(0.5)  # the buffer: filled by any write
    reference = nn.Sequential(nn.Linear(3, 3), _NoReset(), _Scaled())
    reference.load_state_dict(dict(flatshard.get_state_dict(model)[0], **{"1.w": torch.full((3,), 2.0)}))
    reference[2].scale.fill_(0.5)
    torch.testing.assert_close(model(x), reference(x))


def test_meta_init_errors_and_warnings() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3))

    def leaves_meta(m: nn.Module) -> None:
        m.weight = nn.Parameter(torch.empty(3, 3, device="meta"))

    with pytest.raises(ValueError, match="still has meta tensors"):
        flatshard.shard(model, param_init_fn=leaves_meta)
    with pytest.raises(TypeError, match="param_init_fn must be a callable"):
        flatshard.shard(nn.Linear(2, 2), param_init_fn=3)  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="no parameter or buffer is on the meta device"):
        flatshard.shard(nn.Linear(2, 2), param_init_fn=lambda m: None)
    # A param_init_fn that materializes by itself (torch FSDP's contract) works too: parameters are re-acquired.
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), _NoReset())

    def fsdp_style(m: nn.Module) -> None:
        m.to_empty(device="cpu", recurse=False)
        for p in m.parameters(recurse=False):
            p.fill_(0.5)

    flatshard.shard(model, param_init_fn=fsdp_style)
    x = torch.ones(1, 3)
    assert torch.allclose(model(x), torch.full((1, 3), (0.5 * 3 + 0.5) * 0.5))


def test_meta_model_copy_is_independent(tmp_path: Path) -> None:
    """Materialization replaces Parameters in place: a deepcopy made before stays on meta, untouched."""
    with torch.device("meta"):
        model = TinyGPT()
    twin = copy.deepcopy(model)
    flatshard.shard(model)
    assert all(p.is_meta for p in twin.parameters())
    assert not any(p.is_meta for p in model.parameters())
