"""Damaged and foreign sharded directories are refused before anything changes (docs/checkpoints.md, "What
loading checks"; [Note: chunk coverage] in ``flatshard.checkpoint.validate``).

Each fault is injected into a directory's ``.metadata`` (or, for dtypes and extra keys, written by torch itself)
the way a damaged copy or another tool's directory looks: a tensor whose chunks leave a gap (one rank's chunks
missing), overlap, or lie outside its shape; keys the model or the optimizer does not have under ``strict=True``;
an integer tensor stored for a floating-point parameter and the reverse. Every case is tried on flatshard's own
layout (written by 2 ranks) and on a directory torch wrote (FSDP2 ``get_state_dict`` + ``dcp.save`` on 2 ranks,
or a plain ``dcp.save``), through the public loader on 2 gloo ranks; one case each goes through the Trainer
(``fit(ckpt_path=...)``), Fabric (``fabric.load``), and ``flatshard inspect`` / ``consolidate``; the tiling
check itself is tried on hand-made metadata, valid layouts (flatshard's boxes, row and column blocks, an empty
chunk) included.

Every case checks the message (the key, the directory, what is wrong) and that the weights and the optimizer
state are exactly what they were before the load.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

import flatshard
from flatshard import cli
from flatshard.checkpoint import CheckpointError
from flatshard.checkpoint.dcp_layout import flat_boxes
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

FC = "blocks.0.fc.weight"  # (29, 13): 377 elements, cut mid-row by 2 ranks


# ------------------------------------------------------------------------------------- .metadata surgery
def _edit(directory: str | os.PathLike[str], change: Callable[[Metadata], None]) -> None:
    path = Path(directory) / ".metadata"
    md = pickle.loads(path.read_bytes())
    change(md)
    path.write_bytes(pickle.dumps(md))


def _owner(md: Metadata, fqn: str, chunk: ChunkStorageMetadata) -> str:
    return str(md.storage_data[MetadataIndex(fqn, chunk.offsets)].relative_path)


def drop_rank(fqn: str, rank: int) -> Callable[[Metadata], None]:
    """A gap: the chunks rank ``rank`` wrote for ``fqn`` are missing from the metadata."""

    def change(md: Metadata) -> None:
        entry = md.state_dict_metadata[fqn]
        kept = [c for c in entry.chunks if not _owner(md, fqn, c).startswith(f"__{rank}_")]  # type: ignore[union-attr]
        assert 0 < len(kept) < len(entry.chunks), fqn  # type: ignore[union-attr]
        entry.chunks = kept  # type: ignore[union-attr]

    return change


def duplicate_chunk(fqn: str) -> Callable[[Metadata], None]:
    """Overlap: one chunk listed twice."""

    def change(md: Metadata) -> None:
        chunks = md.state_dict_metadata[fqn].chunks  # type: ignore[union-attr]
        chunks.append(chunks[0])

    return change


def shift_rank(fqn: str, rank: int, rows: int) -> Callable[[Metadata], None]:
    """Rank ``rank``'s chunk moved by ``rows`` rows: onto its neighbour's (overlap) or past the end (outside)."""

    def change(md: Metadata) -> None:
        entry = md.state_dict_metadata[fqn]
        for i, chunk in enumerate(entry.chunks):  # type: ignore[union-attr]
            if _owner(md, fqn, chunk).startswith(f"__{rank}_"):
                moved = torch.Size((chunk.offsets[0] + rows, *chunk.offsets[1:]))
                md.storage_data[MetadataIndex(fqn, moved)] = md.storage_data[
                    MetadataIndex(fqn, chunk.offsets)
                ]
                entry.chunks[i] = ChunkStorageMetadata(moved, chunk.sizes)  # type: ignore[union-attr]

    return change


def chunk_past_the_end(fqn: str) -> Callable[[Metadata], None]:
    """A chunk that lies wholly outside the tensor (one row past its last)."""

    def change(md: Metadata) -> None:
        entry = md.state_dict_metadata[fqn]
        first = entry.chunks[0]  # type: ignore[union-attr]
        beyond = torch.Size((entry.size[0], *[0] * (len(entry.size) - 1)))  # type: ignore[union-attr]
        md.storage_data[MetadataIndex(fqn, beyond)] = md.storage_data[MetadataIndex(fqn, first.offsets)]
        entry.chunks.append(ChunkStorageMetadata(beyond, torch.Size((1, *entry.size[1:]))))  # type: ignore[union-attr]

    return change


def copy_entry(like: str, new: str) -> Callable[[Metadata], None]:
    """An extra key: ``new`` stored like ``like`` (the same chunks and bytes)."""

    def change(md: Metadata) -> None:
        entry = md.state_dict_metadata[like]
        md.state_dict_metadata[new] = dataclasses.replace(entry)
        for chunk in entry.chunks:  # type: ignore[union-attr]
            md.storage_data[MetadataIndex(new, chunk.offsets)] = md.storage_data[
                MetadataIndex(like, chunk.offsets)
            ]

    return change


def set_dtype(fqn: str, dtype: torch.dtype) -> Callable[[Metadata], None]:
    def change(md: Metadata) -> None:
        md.state_dict_metadata[fqn].properties.dtype = dtype  # type: ignore[union-attr]

    return change


# ------------------------------------------------------------------------------------- writers (in ranks)
def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, world: int, seed: int = 0) -> None:
    idx, tgt = make_batch(seed, 6)
    part = slice(rank * 6 // world, (rank + 1) * 6 // world)
    F.cross_entropy(model(idx[part]).flatten(0, 1), tgt[part].flatten()).backward()
    opt.step()
    opt.zero_grad()


def _write_own(rank: int, world: int, path: str) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    flatshard.shard(model, auto_wrap_policy={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, rank, world)
    flatshard.save_checkpoint(path, model, opt, state_dict_type="sharded")


def _write_fsdp2(rank: int, world: int, path: str, n_layer: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyGPT(n_layer=n_layer)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, rank, world)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _write_plain(path: str, key: str, value: torch.Tensor) -> None:
    """torch's own ``dcp.save`` of a plain state dict with ``key`` replaced by ``value`` (this process alone)."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    state = dict(TinyGPT().state_dict())
    state[key] = value
    dcp.save({"model": state}, checkpoint_id=path, no_dist=True)


# (case, base directory, fault, the key the message must name, what it must say, load the optimizer too)
OWN, TORCH, BIG, INTS, FLOATS = "own", "fsdp2", "fsdp2_4_blocks", "plain_int64", "plain_float_steps"
FULL, FULL_INTS = "full.ckpt", "full_int64_exp_avg.ckpt"  # a full file, and one with an int64 optimizer state
CASES: list[tuple[str, str, Callable[[Metadata], None] | None, str, str, bool]] = [
    ("own-gap", OWN, drop_rank(f"model.{FC}", 1), FC, "cover", True),
    ("own-overlap", OWN, duplicate_chunk(f"model.{FC}"), FC, "overlap", True),
    ("own-outside", OWN, chunk_past_the_end(f"model.{FC}"), FC, "outside", True),
    (
        "own-extra-model-key",
        OWN,
        copy_entry(f"model.{FC}", "model.blocks.3.fc.weight"),
        "blocks.3.fc.weight",
        "unexpected",
        True,
    ),
    (
        "own-extra-optimizer-key",
        OWN,
        copy_entry(f"optimizer_0.state.{FC}.exp_avg", "optimizer_0.state.blocks.3.fc.weight.exp_avg"),
        "blocks.3.fc.weight",
        "optimizer",
        True,
    ),
    ("own-int-into-float", OWN, set_dtype(f"model.{FC}", torch.int32), FC, "torch.int32", True),
    ("own-float-into-int", OWN, set_dtype("model.steps", torch.float32), "steps", "torch.float32", True),
    ("torch-gap", TORCH, drop_rank(f"model.{FC}", 1), FC, "cover", True),
    ("torch-overlap", TORCH, shift_rank(f"model.{FC}", 1, -1), FC, "overlap", True),
    ("torch-outside", TORCH, shift_rank(f"model.{FC}", 1, 1), FC, "outside", True),
    ("torch-extra-model-keys", BIG, None, "blocks.3.", "unexpected", False),
    (
        "torch-extra-optimizer-key",
        TORCH,
        copy_entry(f"optim.state.{FC}.exp_avg", "optim.state.blocks.3.fc.weight.exp_avg"),
        "blocks.3.fc.weight",
        "optimizer",
        True,
    ),
    ("torch-int-into-float", INTS, None, FC, "torch.int64", False),
    ("torch-float-into-int", FLOATS, None, "steps", "torch.float32", False),
]


# ------------------------------------------------------------------------------------- loading (in ranks)
def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    weights, optim = flatshard.get_state_dict(model, opt, full=True, rank0_only=False)
    return {k: v.clone() for k, v in weights.items()}, optim


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def _try_load(
    path: str, n_layer: int, with_optimizer: bool, rank: int, world: int, **kwargs: Any
) -> dict[str, Any]:
    torch.manual_seed(1)  # other weights than the checkpoint's
    model = TinyGPT(n_layer=n_layer)
    flatshard.shard(model, auto_wrap_policy={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, rank, world, seed=5)  # optimizer state to keep
    before = _snapshot(model, opt)
    try:
        flatshard.load_checkpoint(path, model, opt if with_optimizer else None, **kwargs)
        error = None
    except CheckpointError as err:
        error = str(err)
    after = _snapshot(model, opt)
    return {
        "error": error,
        "weights_unchanged": _same(before[0], after[0]),
        "optimizer_unchanged": _same(before[1], after[1]),
        "weights": after[0] if rank == 0 else None,
    }


def _write_full_with_int_optimizer_state(rank: int, world: int, root: Path) -> None:
    """A full file, then a copy whose first AdamW ``exp_avg`` is stored as int64."""
    torch.manual_seed(0)
    model = TinyGPT()
    flatshard.shard(model, auto_wrap_policy={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, rank, world)
    flatshard.save_checkpoint(root / FULL, model, opt)
    if rank == 0:
        checkpoint = torch.load(root / FULL, weights_only=True)
        state = checkpoint["optimizer_states"][0]["state"]
        first = min(state)
        state[first]["exp_avg"] = torch.ones_like(state[first]["exp_avg"], dtype=torch.int64)
        torch.save(checkpoint, root / FULL_INTS)


def _bases(rank: int, world: int, root: Path) -> None:
    _write_full_with_int_optimizer_state(rank, world, root)
    _write_own(rank, world, str(root / OWN))
    _write_fsdp2(rank, world, str(root / TORCH), 3)
    _write_fsdp2(rank, world, str(root / BIG), 4)
    if rank == 0:
        _write_plain(str(root / INTS), FC, torch.arange(377).reshape(29, 13))
        _write_plain(str(root / FLOATS), "steps", torch.tensor(3.0))
        for name, base, fault, *_ in CASES:
            shutil.copytree(root / base, root / name)
            if fault is not None:
                _edit(root / name, fault)
    dist.barrier()


def _load_every_case(rank: int, world: int, root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    _bases(rank, world, Path(root))
    results = {
        name: _try_load(str(Path(root) / name), 3, with_optimizer, rank, world)
        for name, _, _, _, _, with_optimizer in CASES
    }
    # what must keep loading: the bigger model's directory without strict, the integers when asked for
    results["lenient"] = _try_load(str(Path(root) / BIG), 3, False, rank, world, strict=False)
    results["cast"] = _try_load(str(Path(root) / INTS), 3, False, rank, world, allow_dtype_kind_cast=True)
    full = str(Path(root) / FULL_INTS)
    results["full-int-optimizer-state"] = _try_load(full, 3, True, rank, world)
    results["full-cast"] = _try_load(full, 3, True, rank, world, allow_dtype_kind_cast=True)
    return results


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("faults")
    return {"root": root, "ranks": spawn(_load_every_case, 2, str(root))}


def test_a_full_file_with_optimizer_state_of_another_kind_is_refused(loaded: dict[str, Any]) -> None:
    path = str(loaded["root"] / FULL_INTS)
    for rank, results in enumerate(loaded["ranks"]):
        refused, cast = results["full-int-optimizer-state"], results["full-cast"]
        error = refused["error"]
        assert error is not None and path in error and "'exp_avg'" in error and "torch.int64" in error, error
        assert "allow_dtype_kind_cast=True" in error, error
        assert refused["weights_unchanged"] and refused["optimizer_unchanged"], rank
        assert cast["error"] is None and not cast["optimizer_unchanged"], (rank, cast)


@pytest.mark.parametrize(
    ("name", "key", "what"), [(c[0], c[3], c[4]) for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_damaged_or_foreign_directory_is_refused_before_anything_changes(
    loaded: dict[str, Any], name: str, key: str, what: str
) -> None:
    directory = str(loaded["root"] / name)
    for rank, results in enumerate(loaded["ranks"]):
        result = results[name]
        error = result["error"]
        assert error is not None, f"{name}: rank {rank} loaded it"
        assert key in error and directory in error and what in error and "HINT:" in error, (name, error)
        assert result["weights_unchanged"] and result["optimizer_unchanged"], (name, rank)


def test_what_is_allowed_still_loads(loaded: dict[str, Any]) -> None:
    for results in loaded["ranks"]:
        assert results["lenient"]["error"] is None, results["lenient"]["error"]
        assert results["cast"]["error"] is None, results["cast"]["error"]
    weights = loaded["ranks"][0]["cast"]["weights"]
    assert weights[FC].dtype == torch.float32
    assert torch.equal(weights[FC], torch.arange(377, dtype=torch.float32).reshape(29, 13))


def test_inspect_and_consolidate_refuse_a_gap(
    loaded: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gap = str(loaded["root"] / "own-gap")
    assert cli.main(["inspect", gap]) == 2
    shown = capsys.readouterr().err
    assert FC in shown and gap in shown and "cover" in shown, shown
    with pytest.raises(CheckpointError, match="cover") as err:
        flatshard.consolidate(gap, tmp_path / "full.ckpt")
    assert FC in str(err.value) and gap in str(err.value)
    assert not (tmp_path / "full.ckpt").exists()


def _metadata(shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> Metadata:
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    stored = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks]
    return Metadata({"w": TensorStorageMetadata(TensorProperties(torch.float32), torch.Size(shape), stored)})


def _boxes(shape: tuple[int, ...], ranks: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """flatshard's layout: each rank's flat range as boxes (see [Note: DCP-native layout])."""
    numel = int(torch.Size(shape).numel())
    cuts = [numel * r // ranks for r in range(ranks + 1)]
    return [(b.offsets, b.sizes) for r in range(ranks) for b in flat_boxes(shape, cuts[r], cuts[r + 1])]


@pytest.mark.parametrize(
    ("shape", "chunks", "problem"),
    [
        ((29, 13), _boxes((29, 13), 3), None),
        ((3, 4, 5), _boxes((3, 4, 5), 7), None),
        ((29, 13), [((0, 0), (15, 13)), ((15, 0), (14, 13))], None),  # FSDP row blocks
        ((4, 10), [((0, c), (4, 1)) for c in range(10)], None),  # column blocks
        ((2, 13), [((0, 0), (2, 13)), ((2, 0), (0, 13))], None),  # a rank holding no rows
        ((), [((), ())], None),
        ((29, 13), _boxes((29, 13), 3)[1:], "cover only"),
        ((4, 10), [((0, 0), (4, 5)), ((0, 4), (4, 6))], "overlap"),
        ((), [((), ()), ((), ())], "overlap"),
        ((5, 13), [((0,), (65,))], "outside"),
        ((5, 13), [((-1, 0), (6, 13))], "outside"),
    ],
)
def test_chunks_must_tile_the_shape(shape: Any, chunks: Any, problem: str | None) -> None:
    from flatshard.checkpoint.validate import check_chunks

    if problem is None:
        check_chunks("dir", _metadata(shape, chunks))
    else:
        with pytest.raises(CheckpointError, match=f"'w' .*{problem}"):
            check_chunks("dir", _metadata(shape, chunks))


def test_strategies_check_the_opt_in() -> None:
    with pytest.raises(TypeError, match="allow_dtype_kind_cast must be True or False"):
        flatshard.FlatShardStrategy(allow_dtype_kind_cast="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="allow_dtype_kind_cast must be True or False"):
        flatshard.FlatShardFabricStrategy(allow_dtype_kind_cast=1)  # type: ignore[arg-type]
    assert flatshard.FlatShardStrategy(allow_dtype_kind_cast=True).options.allow_dtype_kind_cast


# ------------------------------------------------------------------------------------- Trainer and Fabric
def _trainer_resumes_a_gap(rank: int, world: int, root: str) -> dict[str, Any]:
    from tests.lightning.lit_common import LitGPT, make_loader, make_trainer

    torch.set_num_threads(1)
    ckpt = os.path.join(root, "trainer.ckpt")
    strategy = flatshard.FlatShardStrategy(state_dict_type="sharded", auto_wrap_policy={Block})
    trainer = make_trainer(world, strategy, max_steps=1)
    trainer.fit(LitGPT(), make_loader(1, 6, world))
    trainer.save_checkpoint(ckpt)
    if rank == 0:
        _edit(ckpt, drop_rank(f"model.model.{FC}", 1))
    dist.barrier()
    model = LitGPT(seed=123)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    strategy = flatshard.FlatShardStrategy(state_dict_type="sharded", auto_wrap_policy={Block})
    trainer = make_trainer(world, strategy, max_steps=2)
    try:
        trainer.fit(model, make_loader(2, 6, world), ckpt_path=ckpt)
        error = None
    except CheckpointError as err:
        error = str(err)
    after, _ = flatshard.get_state_dict(model, full=True, rank0_only=False)
    return {
        "error": error,
        "unchanged": _same(before, dict(after)),
        "optimizer_state": sum(len(o.state) for o in trainer.optimizers),
        "global_step": trainer.global_step,
    }


@pytest.mark.slow
def test_trainer_refuses_a_directory_with_a_gap(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "trainer.ckpt")
    for result in spawn(_trainer_resumes_a_gap, 2, str(tmp_path)):
        error = result["error"]
        assert error is not None and f"model.{FC}" in error and ckpt in error and "cover" in error, error
        assert result["unchanged"] and result["optimizer_state"] == 0 and result["global_step"] == 0


def _fabric_loads_an_extra_key(rank: int, world: int, root: str) -> dict[str, Any]:
    from lightning.fabric import Fabric

    torch.set_num_threads(1)
    strategy = flatshard.FlatShardFabricStrategy(state_dict_type="sharded", auto_wrap_policy={Block})
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    path = os.path.join(root, "fabric")
    torch.manual_seed(0)
    model = fabric.setup_module(TinyGPT())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _step(model, opt, rank, world)
    fabric.save(path, {"model": model, "optimizer": opt, "step": 1})
    if rank == 0:
        _edit(path, copy_entry(f"model.{FC}", "model.blocks.3.fc.weight"))
    fabric.barrier()
    torch.manual_seed(1)
    other = fabric.setup_module(TinyGPT())
    other_opt = fabric.setup_optimizers(torch.optim.AdamW(other.parameters(), lr=1e-2))
    _step(other, other_opt, rank, world, seed=5)
    before = _snapshot(other, other_opt.optimizer)
    state = {"model": other, "optimizer": other_opt, "step": 0}
    try:
        fabric.load(path, state)
        error = None
    except CheckpointError as err:
        error = str(err)
    after = _snapshot(other, other_opt.optimizer)
    return {"error": error, "unchanged": _same(before, after), "step": state["step"]}


@pytest.mark.slow
def test_fabric_refuses_a_key_the_model_does_not_have(tmp_path: Path) -> None:
    path = str(tmp_path / "fabric")
    for result in spawn(_fabric_loads_an_extra_key, 2, str(tmp_path)):
        error = result["error"]
        assert error is not None and "blocks.3.fc.weight" in error and path in error, error
        assert "unexpected" in error and "HINT:" in error, error
        assert result["unchanged"] and result["step"] == 0


def _fabric_loads_a_file_damaged_on_one_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """A full file that rank 1 cannot read (its node's copy is truncated: injected), the other rank can."""
    from lightning.fabric import Fabric

    from flatshard.checkpoint import load as load_module

    torch.set_num_threads(1)
    fabric = Fabric(
        accelerator="cpu", devices=world, strategy=flatshard.FlatShardFabricStrategy(auto_wrap_policy={Block})
    )
    fabric.launch()
    path = os.path.join(root, "fabric.ckpt")
    torch.manual_seed(0)
    model = fabric.setup_module(TinyGPT())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _step(model, opt, rank, world)
    fabric.save(path, {"model": model, "optimizer": opt, "step": 1})
    if rank == 1:

        def truncated(*args: Any, **kwargs: Any) -> Any:
            raise CheckpointError(f"Checkpoint {path} is truncated (injected on rank 1).")

        load_module.load_checkpoint_file = truncated  # type: ignore[assignment]
    torch.manual_seed(1)
    other = fabric.setup_module(TinyGPT())
    other_opt = fabric.setup_optimizers(torch.optim.AdamW(other.parameters(), lr=1e-2))
    before = _snapshot(other, other_opt.optimizer)
    state = {"model": other, "optimizer": other_opt, "step": 0}
    started = time.monotonic()
    try:
        fabric.load(path, state)
        error = None
    except CheckpointError as err:
        error = str(err)
    seconds = time.monotonic() - started
    fabric.barrier()  # both ranks are still in step: nobody went on alone
    after = _snapshot(other, other_opt.optimizer)
    return {"error": error, "seconds": seconds, "unchanged": _same(before, after), "step": state["step"]}


@pytest.mark.slow
def test_fabric_fails_on_every_rank_when_one_rank_cannot_read_a_full_file(tmp_path: Path) -> None:
    loaded, failed = spawn(_fabric_loads_a_file_damaged_on_one_rank, 2, str(tmp_path), timeout=120)
    assert failed["error"] is not None and "truncated (injected on rank 1)" in failed["error"], failed
    assert loaded["error"] is not None and "Loading failed on rank 1" in loaded["error"], loaded
    assert "truncated" in loaded["error"], loaded
    for result in (loaded, failed):
        assert result["seconds"] < 30 and result["unchanged"] and result["step"] == 0, result
