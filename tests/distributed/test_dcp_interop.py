"""Sharded checkpoints in torch's DCP layout, both ways (see [Note: DCP-native layout]).

Every writer trains ``TinyGPT`` (tied head, odd sizes, so pieces cut rows in the middle) for two AdamW steps on
the same global batch of 6 and saves a sharded directory; every reader loads it on another world size and
returns the full model and optimizer state. Both are compared with one unsharded model trained on the whole
batch in the pytest process: weights, ``exp_avg``, ``exp_avg_sq`` and ``step`` equal to 1e-5.

Writers and readers: flatshard (this format, version 2), torch FSDP1 ``SHARDED_STATE_DICT`` saved as
Lightning's ``FSDPStrategy`` saves it (``model`` / ``optimizer_0`` keys through Lightning's own
``_distributed_checkpoint_save``, ``meta.pt`` beside), FSDP2 with ``get_state_dict`` under Lightning
``ModelParallelStrategy``'s keys (``state_dict`` / ``optimizer_0``) and a plain user's (``model`` / ``optim``),
and torch's ``dcp_to_torch_save``. Version 1 directories still load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import flatshard
from flatshard import cli
from flatshard.checkpoint import CheckpointError, ShardedReader
from flatshard.checkpoint.dcp_layout import flat_boxes
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

GLOBAL_BATCH, STEPS, LR = 6, 2, 1e-2
TOL = {"atol": 1e-5, "rtol": 1e-5}
ELEMENTWISE = ("exp_avg", "exp_avg_sq")


def _loss(model: torch.nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    idx, tgt = make_batch(step, GLOBAL_BATCH)
    part = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return F.cross_entropy(model(idx[part]).flatten(0, 1), tgt[part].flatten())


def _train(model: torch.nn.Module, rank: int, world: int) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        _loss(model, step, rank, world).backward()
        opt.step()
        opt.zero_grad()
    return opt


def _named_state(model: torch.nn.Module, opt_state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A plain (index-keyed) optimizer state keyed by parameter name instead."""
    names = [n for n, _ in model.named_parameters()]
    return {names[i]: dict(v) for i, v in opt_state["state"].items()}


def _reference() -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = _train(model, 0, 1)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, _named_state(
        model, opt.state_dict()
    )


def _assert_matches(
    weights: dict[str, torch.Tensor], state: dict[str, dict[str, Any]], what: str, tied_once: bool = False
) -> None:
    ref_weights, ref_state = _reference()
    expected_keys = sorted(ref_weights)
    assert sorted(weights) == expected_keys, (what, sorted(weights))
    for key, value in ref_weights.items():
        torch.testing.assert_close(weights[key].reshape(value.shape), value, **TOL, msg=f"{what}: {key}")
        assert weights[key].shape == value.shape, (what, key, weights[key].shape)
    assert sorted(state) == sorted(ref_state), (what, sorted(state))
    for name, entries in ref_state.items():
        for key in (*ELEMENTWISE, "step"):
            got = state[name][key]
            torch.testing.assert_close(
                torch.as_tensor(got, dtype=torch.float32).reshape(torch.as_tensor(entries[key]).shape),
                torch.as_tensor(entries[key], dtype=torch.float32),
                **TOL,
                msg=f"{what}: {name} {key}",
            )


# ------------------------------------------------------------------------------------- writers (in ranks)
def _write_flatshard(rank: int, world: int, path: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT()
    flatshard.shard(model, auto_wrap_policy={Block})
    opt = _train(model, rank, world)
    flatshard.save_checkpoint(path, model, opt, state_dict_type="sharded", extra={"step": STEPS})


def _fsdp1(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    # torch refuses device_id=None for a CPU module; an explicit CPU device selects the CPU path.
    return FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"), use_orig_params=True
    )


def _write_fsdp1_as_lightning(rank: int, world: int, path: str) -> None:
    """What Lightning's ``FSDPStrategy(state_dict_type="sharded").save_checkpoint`` writes."""
    from lightning.fabric.strategies.fsdp import _distributed_checkpoint_save, _get_sharded_state_dict_context
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _fsdp1(TinyGPT())
    opt = _train(model, rank, world)
    with _get_sharded_state_dict_context(model):
        state = {"model": model.state_dict(), "optimizer_0": FSDP.optim_state_dict(model, opt)}
    Path(path).mkdir(parents=True, exist_ok=True)
    _distributed_checkpoint_save(state, Path(path))
    if rank == 0:
        torch.save({"epoch": 1, "global_step": STEPS}, Path(path) / "meta.pt")


def _fsdp2(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block)
    fully_shard(model)
    return model


def _write_fsdp2(rank: int, world: int, path: str, model_key: str, optim_key: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _fsdp2(TinyGPT())
    opt = _train(model, rank, world)
    msd, osd = get_state_dict(model, opt)
    dcp.save({model_key: msd, optim_key: osd}, checkpoint_id=path)


def _write_fsdp2_flattened(rank: int, world: int, path: str) -> None:
    """torch's flattened optimizer layout (``flatten_optimizer_state_dict``: ``state.<name>.<key>``,
    ``param_groups.<name>.<field>``) beside bare model keys, as torchtitan's checkpoints hold them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _fsdp2(TinyGPT())
    opt = _train(model, rank, world)
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({**msd, "optimizer": osd}, checkpoint_id=path)


# ------------------------------------------------------------------------------------- readers (in ranks)
def _load_flatshard(rank: int, world: int, path: str) -> dict[str, Any] | None:
    torch.set_num_threads(1)
    torch.manual_seed(1)  # other weights: everything must come from the checkpoint
    model = TinyGPT()
    flatshard.shard(model, auto_wrap_policy={Block} if world != 3 else None)
    opt = _train(model, rank, world)  # non-empty state to be replaced
    extra = flatshard.load_checkpoint(path, model, opt)
    weights, optim = flatshard.get_state_dict(model, opt, full=True, rank0_only=True)
    if rank != 0:
        return None
    reference = TinyGPT()
    return {"weights": weights, "state": _named_state(reference, optim), "extra": extra}


def _load_fsdp1_as_lightning(rank: int, world: int, path: str) -> dict[str, Any] | None:
    """What Lightning's ``FSDPStrategy.load_checkpoint`` does with a sharded directory."""
    from lightning.fabric.strategies.fsdp import _distributed_checkpoint_load, _get_sharded_state_dict_context
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.set_num_threads(1)
    torch.manual_seed(1)
    model = _fsdp1(TinyGPT())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    with _get_sharded_state_dict_context(model):
        module_state = {"model": model.state_dict()}
        _distributed_checkpoint_load(module_state, Path(path))
        model.load_state_dict(module_state["model"])
        optim_state = load_sharded_optimizer_state_dict(
            model_state_dict=module_state["model"],
            optimizer_key="optimizer_0",
            storage_reader=FileSystemReader(path),
        )
        opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, optim_state["optimizer_0"]))
    meta = torch.load(Path(path) / "meta.pt", weights_only=False)
    with FSDP.state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        # offload_to_cpu=True crashes FSDP1's CPU path in torch 2.13 (the tensors are on the CPU anyway)
        FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
        FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
    ):
        weights = model.state_dict()
        optim = FSDP.optim_state_dict(model, opt)
    return {"weights": weights, "state": optim["state"], "extra": meta} if rank == 0 else None


def _load_fsdp2(rank: int, world: int, path: str) -> dict[str, Any] | None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    torch.set_num_threads(1)
    torch.manual_seed(1)
    model = _fsdp2(TinyGPT())
    opt = _train(model, rank, world)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optimizer_0": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer_0"])
    weights, optim = get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {"weights": weights, "state": optim["state"]} if rank == 0 else None


# ------------------------------------------------------------------------------------- tests
def test_flat_boxes_tile_the_range_and_are_contiguous() -> None:
    for shape in [(), (7,), (5, 13), (3, 4, 5), (2, 3, 1, 4)]:
        numel = int(torch.tensor(shape).prod()) if shape else 1
        full = torch.arange(numel).reshape(shape)
        for start in range(numel + 1):
            for stop in range(start, numel + 1):
                boxes = flat_boxes(shape, start, stop)
                assert len(boxes) <= max(1, 2 * len(shape) - 1)
                flat = []
                for b in boxes:
                    block = full[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))]
                    assert block.shape == torch.Size(b.sizes) and int(block.reshape(-1)[0]) == b.start
                    flat.append(block.reshape(-1))
                got = torch.cat(flat) if flat else torch.empty(0, dtype=full.dtype)
                assert torch.equal(got, torch.arange(start, stop)), (shape, start, stop)


@pytest.mark.slow
def test_flatshard_directory_holds_global_shapes_for_torch_tools(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = tmp_path / "ckpt"
    spawn(_write_flatshard, 3, str(ckpt))
    assert (ckpt / "meta.pt").is_file()
    dcp_to_torch_save(ckpt, tmp_path / "plain.pt")
    plain = torch.load(tmp_path / "plain.pt", weights_only=False)
    assert plain["model"]["wte.weight"].shape == (37, 13)
    state = plain["optimizer_0"]["state"]
    assert state["wte.weight"]["exp_avg"].shape == (37, 13)
    _assert_matches(plain["model"], state, "dcp_to_torch_save")
    assert plain["flatshard"]["extra"] == {"step": STEPS}
    assert torch.load(ckpt / "meta.pt", weights_only=False) == {"step": STEPS}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_flatshard_loads_a_lightning_fsdp_sharded_checkpoint_on_any_world_size(
    tmp_path: Path, world: int
) -> None:
    ckpt = tmp_path / "fsdp"
    spawn(_write_fsdp1_as_lightning, 2, str(ckpt))
    result = spawn(_load_flatshard, world, str(ckpt))[0]
    _assert_matches(result["weights"], result["state"], f"FSDP1 -> flatshard on {world}")
    assert result["extra"] == {"epoch": 1, "global_step": STEPS}


@pytest.mark.slow
@pytest.mark.parametrize("keys", [("state_dict", "optimizer_0"), ("model", "optim")])
def test_flatshard_loads_fsdp2_get_state_dict_checkpoints(tmp_path: Path, keys: tuple[str, str]) -> None:
    ckpt = tmp_path / "fsdp2"
    spawn(_write_fsdp2, 2, str(ckpt), *keys)
    result = spawn(_load_flatshard, 3, str(ckpt))[0]
    _assert_matches(result["weights"], result["state"], f"FSDP2 {keys} -> flatshard")
    assert result["extra"] == {}


@pytest.mark.slow
def test_flatshard_loads_bare_model_keys_and_a_flattened_optimizer(tmp_path: Path) -> None:
    ckpt = tmp_path / "flattened"
    spawn(_write_fsdp2_flattened, 2, str(ckpt))
    result = spawn(_load_flatshard, 3, str(ckpt))[0]
    _assert_matches(result["weights"], result["state"], "flattened FSDP2 -> flatshard")


@pytest.mark.slow
def test_lightning_fsdp_and_fsdp2_load_a_flatshard_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "flatshard"
    spawn(_write_flatshard, 3, str(ckpt))
    fsdp1 = spawn(_load_fsdp1_as_lightning, 2, str(ckpt))[0]
    _assert_matches(fsdp1["weights"], fsdp1["state"], "flatshard -> Lightning FSDP")
    assert fsdp1["extra"] == {"step": STEPS}
    fsdp2 = spawn(_load_fsdp2, 2, str(ckpt))[0]
    _assert_matches(fsdp2["weights"], fsdp2["state"], "flatshard -> FSDP2")


@pytest.mark.slow
def test_a_foreign_checkpoint_of_another_model_is_refused_before_anything_changes(tmp_path: Path) -> None:
    ckpt = tmp_path / "fsdp2"
    spawn(_write_fsdp2, 2, str(ckpt), "model", "optim")
    torch.manual_seed(0)
    model = TinyGPT(d_model=16)
    flatshard.shard(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"'wte.weight' has shape \(37, 13\) in the checkpoint") as err:
        flatshard.load_checkpoint(ckpt, model)
    assert str(ckpt) in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_other_param_groups_are_refused_before_anything_changes(tmp_path: Path) -> None:
    ckpt = tmp_path / "flatshard"
    spawn(_write_flatshard, 2, str(ckpt))
    torch.manual_seed(1)
    model = TinyGPT()
    flatshard.shard(model)
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": matrices}, {"params": others, "weight_decay": 0.0}], lr=LR)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"param groups do not match the checkpoint's.*HINT"):
        flatshard.load_checkpoint(ckpt, model, opt)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not opt.state


@pytest.mark.slow
def test_consolidate_and_inspect_read_a_lightning_fsdp_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "fsdp"
    spawn(_write_fsdp1_as_lightning, 2, str(ckpt))
    assert ShardedReader(ckpt).version == 0
    assert cli.main(["inspect", str(ckpt)]) == 0
    shown = capsys.readouterr().out
    assert "written by another tool" in shown and "global_step: 2" in shown
    assert "wte.weight" in shown and "(37, 13)" in shown and "exp_avg_sq" in shown
    out = flatshard.consolidate(ckpt, tmp_path / "full.ckpt")
    full = torch.load(out, weights_only=False)
    assert full["epoch"] == 1 and full["global_step"] == STEPS
    reference = TinyGPT()
    weights = dict(full["state_dict"])
    weights.setdefault("head.weight", weights["wte.weight"])  # FSDP1 stores the tied head under both names
    _assert_matches(weights, _named_state(reference, full["optimizer_states"][0]), "consolidated FSDP1")


V1_DIR = Path(__file__).parent.parent / "data" / "sharded_v1"


@pytest.mark.skipif(not (V1_DIR / ".metadata").is_file(), reason="no version 1 sample in this checkout")
def test_a_version_1_directory_still_loads(tmp_path: Path) -> None:
    assert ShardedReader(V1_DIR).version == 1
    result = spawn(_load_flatshard, 3, str(V1_DIR))[0]
    _assert_matches(result["weights"], result["state"], "version 1 -> flatshard")
    assert result["extra"] == {"step": STEPS}
    out = flatshard.consolidate(V1_DIR, tmp_path / "v1.ckpt")
    full = torch.load(out, weights_only=False)
    _assert_matches(
        full["state_dict"], _named_state(TinyGPT(), full["optimizer_states"][0]), "version 1 consolidated"
    )
