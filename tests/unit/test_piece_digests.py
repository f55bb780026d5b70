"""The digests that tell an owner its whole copy of a parameter is stale (see [Note: whole-tensor optimizers]):
equal bits give equal digests, and a change of one word, or words moved, gives another, for every dtype and
for pieces longer than one chunk; the device sum (CUDA) is run here on the CPU."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from flatshard.engine.step.whole_tensor import _CHUNK, _digests, _sum_digests


@pytest.mark.parametrize("digest", [_digests, _sum_digests], ids=["crc32", "positional_sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.uint8])
def test_digests_see_one_changed_word_and_moved_words(
    digest: Callable[[list[torch.Tensor]], list[int]], dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(0)
    base = (torch.rand(_CHUNK + 1000, generator=g) * 200).to(dtype)  # longer than one chunk of words
    same = base.clone()
    last = base.clone()
    last[-1] += 1  # in the second chunk
    first = base.clone()
    first[0] = base[0] + 1
    swapped = base.clone()
    i, j = 5, 1_000
    assert base[i] != base[j]
    swapped[i], swapped[j] = base[j], base[i]
    tiny = base.clone()
    if dtype.is_floating_point:  # the lowest bit of one element
        tiny.view(torch.int16 if dtype != torch.float64 else torch.int64)[7] ^= 1
    else:
        tiny[7] ^= 1
    values = digest([base, same, last, first, swapped, tiny, base[:0]])
    assert values[0] == values[1]
    assert len({values[0], *values[2:6]}) == 5, values
    assert values[6] == digest([torch.empty(0, dtype=dtype)])[0]
