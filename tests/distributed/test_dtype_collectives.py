"""Collectives move every dtype a tensor can hold bit for bit (see [Note: dtypes on the wire]): the flat all-gather
and the streamed full-state gather, over shared memory and over gloo (which refuses float8, uint16-64, int16,
complex32, the bits dtypes and float4 pairs as they are, and gathers no complex tensor). Reductions refuse the
dtypes they cannot sum, on every rank and before any collective, and a trainable parameter of such a dtype is
refused with a hint."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from flatshard.engine.flat_param import FlatLayout
from flatshard.engine.state import stream_gather as gather
from flatshard.engine.transport import comm
from flatshard.testing import spawn
from tests.dtype_cases import SAVED, bits, dtype_name, sample

DTYPES = [d for d in SAVED if not sample(d).is_quantized]  # what a flat parameter can hold
SHAPES = (torch.Size([7, 30]), torch.Size([5]), torch.Size([0]), torch.Size([3, 11]))


def _zeros(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(n * dtype.itemsize, dtype=torch.uint8).view(dtype)


def _all_gather(rank: int, world: int, dtype: torch.dtype) -> bool:
    shard = sample(dtype, (13,), seed=rank)
    output = _zeros(13 * world, dtype)
    comm.all_gather_flat(output, shard, None, async_op=False)
    return all(
        bits(output[13 * r : 13 * (r + 1)]) == bits(sample(dtype, (13,), seed=r)) for r in range(world)
    )


def _gather_items(rank: int, world: int, dtype: torch.dtype, keep: bool) -> bool:
    layout = FlatLayout(SHAPES, world)
    full = sample(dtype, (sum(s.numel() for s in SHAPES),), seed=5)
    padded = torch.cat([full, _zeros(layout.padding, dtype)])
    lo, hi = layout.shard_range(rank)
    item = gather.GatherItem(
        None, torch.device("cpu"), layout, dtype, list(range(len(SHAPES))), [(0, padded[lo:hi].clone())]
    )
    (got,) = gather.gather_items([item], keep, chunk_bytes=4096)
    if not keep:
        return got == {}
    parts = torch.split(full, list(layout.numels))
    return all(got[i].dtype == dtype and bits(got[i]) == bits(parts[i].view(SHAPES[i])) for i in got) and len(
        got
    ) == len(SHAPES)


def _run(rank: int, world: int) -> dict[str, object]:
    torch.set_num_threads(1)
    transports: list[str] = []
    real_open = gather.FlatStream._open

    def open_(self: gather.FlatStream) -> None:
        real_open(self)
        transports.append(self.transport)

    gather.FlatStream._open = open_  # type: ignore[method-assign]
    wrong: list[str] = []
    for dtype in DTYPES:
        if not _all_gather(rank, world, dtype):
            wrong.append(f"all_gather_flat {dtype_name(dtype)}")
        for keep in (rank == 0, True):  # gather to one rank, and to all
            if not _gather_items(rank, world, dtype, keep):
                wrong.append(f"gather_items {dtype_name(dtype)} keep={keep}")
    refusals = []
    for reduce in (
        lambda: comm.all_reduce_flat(sample(torch.float8_e4m3fn, (4,)), None, async_op=False),
        lambda: comm.reduce_scatter_flat(
            _zeros(2, torch.uint16), sample(torch.uint16, (2 * world,)), None, async_op=False
        ),
    ):
        try:
            reduce()
            refusals.append("")
        except TypeError as err:
            refusals.append(str(err))
    dist.barrier()  # every rank refused before any collective: none waits in one
    return {"wrong": wrong, "transports": sorted(set(transports)), "refusals": refusals}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("shm", "transport"), [("1", "shm"), ("0", "collective")], ids=["shm", "gloo"])
def test_every_dtype_is_gathered_bit_for_bit(shm: str, transport: str) -> None:
    if shm == "1" and not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    for rank, result in enumerate(spawn(_run, 2, env={"FLATSHARD_SHM": shm})):
        assert result["wrong"] == [], (rank, result["wrong"])
        assert result["transports"] == [transport], (rank, result)
        float8, uint16 = result["refusals"]
        assert "all_reduce_flat: cannot sum torch.float8_e4m3fn tensors" in float8 and "HINT" in float8
        assert "reduce_scatter_flat: cannot sum torch.uint16 tensors" in uint16 and "HINT" in uint16


def test_as_wire_is_a_byte_view_of_the_dtypes_backends_cannot_move() -> None:
    for dtype in DTYPES:
        t = sample(dtype, (3, 4))
        wire = comm.as_wire(t)
        if dtype in comm.NATIVE_DTYPES:
            assert wire is t
            continue
        assert wire.dtype == torch.uint8 and wire.dim() == 1 and wire.numel() == t.numel() * t.element_size()
        assert wire.data_ptr() == t.data_ptr()  # a view: bytes received into it land in t
        wire.zero_()
        assert bits(t) == bytes(t.numel() * t.element_size())
    with pytest.raises(ValueError, match="contiguous"):
        comm.as_wire(sample(torch.float8_e5m2, (4, 6))[:, ::2])
    with pytest.raises(TypeError, match="quantized"):
        comm.as_wire(sample(torch.qint8, (4,)))
    assert comm.as_wire(sample(torch.uint16, ())).shape == (2,)  # a 0-d tensor too


def test_a_trainable_parameter_whose_gradients_cannot_be_reduced_is_refused() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64):
        comm.check_trainable_dtype("w", torch.nn.Parameter(torch.zeros(2, dtype=dtype)))
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.complex32):
        p = torch.nn.Parameter(torch.zeros(2).to(dtype))
        with pytest.raises(
            TypeError, match=rf"'layer.w' requires grad but has dtype {dtype}.*HINT: freeze it"
        ):
            comm.check_trainable_dtype("layer.w", p)
        comm.check_trainable_dtype(
            "layer.w", p.requires_grad_(False)
        )  # frozen: gathered as bytes, never reduced
    comm.check_trainable_dtype(
        "steps", torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
    )


class _Odd(torch.nn.Module):
    """A linear layer beside a frozen float8 parameter and a uint16 buffer, seeded by rank: rank 0's values win
    under ``sync_module_states``."""

    def __init__(self, seed: int, trainable_float8: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(sample(torch.float8_e4m3fn, (6,), seed=seed), requires_grad=False)
        if trainable_float8:  # float8 tensors can require grad: torch allows any floating dtype
            self.scale.requires_grad_(True)
        self.register_buffer("counts", sample(torch.uint16, (5,), seed=seed))


def _shard_odd(rank: int, world: int) -> dict[str, object]:
    import flatshard

    torch.set_num_threads(1)
    try:
        flatshard.shard(_Odd(rank, trainable_float8=True))
        refused = ""
    except TypeError as err:
        refused = str(err)
    model = flatshard.shard(_Odd(rank), sync_module_states=True)
    with flatshard.unshard_params(model):
        scale, counts = bits(model.scale), bits(model.counts)
    return {"refused": refused, "synced": scale == bits(_Odd(0).scale) and counts == bits(_Odd(0).counts)}


@pytest.mark.timeout(120)
def test_sync_module_states_moves_frozen_odd_dtypes_and_refuses_trainable_ones() -> None:
    for rank, result in enumerate(spawn(_shard_odd, 2)):
        assert "'scale' requires grad but has dtype torch.float8_e4m3fn" in str(result["refused"]), (
            rank,
            result,
        )
        assert result["synced"], (rank, result)
