"""Flat layout index math: every element of every parameter is owned by exactly one rank."""

from __future__ import annotations

import pytest
import torch

from flatshard.engine.flat_param import FlatLayout, flatten_tensors, split_flat
from flatshard.engine.transport.pieces import FlatPieces


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("shapes", [[(3, 5), (7,), (1,)], [(2,)], [(13, 3), (29,), (0,), (4, 4)]])
def test_every_element_owned_once(world: int, shapes: list[tuple[int, ...]]) -> None:
    layout = FlatLayout(tuple(torch.Size(s) for s in shapes), world)
    assert layout.padded_numel % world == 0
    assert 0 <= layout.padding < world
    owned = [torch.zeros(n, dtype=torch.int64) for n in layout.numels]
    for rank in range(world):
        lo, hi = layout.shard_range(rank)
        assert hi - lo == layout.shard_numel
        for i, info in enumerate(layout.shard_infos(rank)):
            if info.numel_in_shard:
                assert (
                    0 <= info.offset_in_shard
                    and info.offset_in_shard + info.numel_in_shard <= layout.shard_numel
                )
                owned[i][info.offset_in_param : info.offset_in_param + info.numel_in_shard] += 1
    for i, counts in enumerate(owned):
        assert torch.all(counts == 1), f"param {i} ownership counts {counts.tolist()}"


def test_uneven_three_way_split_pads_at_the_end() -> None:
    layout = FlatLayout((torch.Size([10]),), 3)
    assert (layout.shard_numel, layout.padded_numel, layout.padding) == (4, 12, 2)
    assert [layout.valid_numel(r) for r in range(3)] == [4, 4, 2]
    assert layout.shard_infos(2)[0] == (0, 2, 8)


def test_small_param_absent_from_a_rank_has_empty_piece() -> None:
    layout = FlatLayout((torch.Size([6]), torch.Size([1])), 4)  # 7 elements over 4 ranks of 2
    assert layout.shard_infos(0)[1].numel_in_shard == 0
    assert layout.shard_infos(3)[1] == (0, 1, 0)


def test_flatten_split_roundtrip() -> None:
    tensors = [torch.randn(3, 5), torch.randn(7), torch.randn(2, 2, 2)]
    layout = FlatLayout(tuple(t.shape for t in tensors), 3)
    flat = flatten_tensors(tensors, layout)
    assert flat.numel() == layout.padded_numel
    assert torch.all(flat[layout.total_numel :] == 0)
    for original, view in zip(tensors, split_flat(flat, layout)):
        assert torch.equal(original, view)


def test_rejects_bad_world_and_rank() -> None:
    with pytest.raises(ValueError, match="world_size"):
        FlatLayout((torch.Size([2]),), 0)
    with pytest.raises(ValueError, match="outside the shard group"):
        FlatLayout((torch.Size([2]),), 2).shard_range(2)


def _pieces_and_dense(seed: int) -> tuple[FlatPieces, torch.Tensor]:
    """Random pieces with gaps (one empty, one non-contiguous) and the dense tensor they stand for."""
    g = torch.Generator().manual_seed(seed)
    numel, dense, pieces = 97, torch.zeros(97), []
    for offset, shape in [(0, (3, 4)), (15, (0,)), (15, (5,)), (30, (6, 5)), (80, (2,))]:
        t = torch.randn(shape[::-1], generator=g).t() if len(shape) == 2 else torch.randn(shape, generator=g)
        pieces.append((offset, t))
        dense[offset : offset + t.numel()] = t.reshape(-1)
    return FlatPieces(numel, torch.float32, torch.device("cpu"), pieces), dense


@pytest.mark.parametrize("seed", [0, 1])
def test_flat_pieces_read_like_the_dense_tensor(seed: int) -> None:
    pieces, dense = _pieces_and_dense(seed)
    assert pieces.numel() == 97 and pieces.element_size() == 4
    assert torch.equal(pieces.materialize(torch.full((97,), 5.0)), dense)
    for start in range(0, 97, 7):  # every window, including ones inside a gap or a piece
        for length in {min(k, 97 - start) for k in (0, 1, 6, 19, 97)}:
            dst = torch.full((length,), 5.0)
            pieces.copy_into(dst, start)
            assert torch.equal(dst, dense[start : start + length])
            acc = torch.arange(length, dtype=torch.float32)
            pieces.add_into(acc, start)
            assert torch.equal(acc, torch.arange(length, dtype=torch.float32) + dense[start : start + length])


def test_flat_pieces_convert_dtype_and_reject_overlaps() -> None:
    half = torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
    out = FlatPieces(4, torch.float32, torch.device("cpu"), [(1, half)]).materialize(torch.empty(4))
    assert torch.equal(out, torch.tensor([0.0, 1.5, -2.25, 0.0]))
    with pytest.raises(ValueError, match="overlaps"):
        FlatPieces(8, torch.float32, torch.device("cpu"), [(0, torch.ones(4)), (3, torch.ones(2))])
    with pytest.raises(ValueError, match="runs past 8"):
        FlatPieces(8, torch.float32, torch.device("cpu"), [(6, torch.ones(3))])
