"""Flat layout index math: every element of every parameter is owned by exactly one rank."""

from __future__ import annotations

import pytest
import torch

from flatshard.engine.flat_param import FlatLayout, flatten_tensors, split_flat


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
