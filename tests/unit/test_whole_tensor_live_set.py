"""The error raised when the ranks of a shard group disagree before a whole-tensor exchange (see [Note: the ranks
agree before an all-to-all]): it names the ranks that differ, the parameters or tensors they differ in, and how to
fix it; the plan's digest tells plans apart by every field the splits are computed from. No processes: the
records each rank would contribute are built here (tests/distributed/test_whole_tensor_optim.py raises them on
spawned ranks)."""

from __future__ import annotations

from flatshard.engine.step.whole_exchange import mismatch_message
from flatshard.engine.step.whole_plan import digest

PARAMS = [("0.weight", (40, 16), 1, (340, 300)), ("2.weight", (24, 40), 0, (480, 480))]


def test_other_live_parameters_are_named_with_the_ranks_on_each_side() -> None:
    everyone = [
        {"params": PARAMS, "live": ["0.weight", "2.weight"]},
        {"params": PARAMS, "live": ["0.weight", "2.weight"]},
        {"params": PARAMS, "live": ["0.weight"]},
    ]
    text = mismatch_message(everyone, [4, 5, 6], 1, "Muon.step()")
    assert text.startswith("flatshard (rank 5): the ranks of a shard group (global ranks [4, 5, 6]) disagree")
    assert "Muon.step()" in text and "nothing was exchanged" in text
    assert "'2.weight' has a gradient on ranks [4, 5], none on ranks [6]" in text
    assert "0.weight'" not in text.split("differ:")[1]  # the parameter all ranks agree on is not listed
    assert "HINT: every rank must step the same parameters" in text


def test_other_plans_name_the_first_difference() -> None:
    mine = list(PARAMS)
    theirs = [PARAMS[0], ("2.weight", (24, 40), 1, (480, 480))]  # another owner
    text = mismatch_message(
        [{"params": mine, "live": []}, {"params": theirs, "live": []}], [0, 1], 0, "Adafactor.step()"
    )
    assert "global rank 0 has 2, global ranks [1] others (global rank 1: 2)" in text
    assert (
        "at #1: ('2.weight', (24, 40), 0, (480, 480)) on rank 0, ('2.weight', (24, 40), 1, (480, 480))"
        in text
    )
    assert "HINT: build the optimizer over the same parameters, in the same order, on every rank." in text
    shorter = mismatch_message([{"params": mine}, {"params": mine[:1]}], [0, 1], 1, "Muon.step()")
    assert "at #1: ('2.weight', (24, 40), 0, (480, 480)) on rank 0, nothing on rank 1" in shorter


def test_other_tensors_of_a_load_are_named() -> None:
    everyone = [
        {"params": PARAMS, "items": ["('0.weight', 'momentum_buffer', 'torch.float32')"]},
        {"params": PARAMS, "items": []},
    ]
    text = mismatch_message(everyone, [0, 1], 0, "making Muon's loaded state whole")
    assert "Global ranks [1] move other tensors than global rank 0" in text
    assert "momentum_buffer" in text and "HINT: load the same checkpoint on every rank" in text


def test_plan_digests_see_every_field_the_splits_come_from() -> None:
    base = digest((2, PARAMS))
    assert base == digest((2, list(PARAMS))) and 0 <= base < 1 << 62
    changed = [
        (3, PARAMS),  # world size
        (2, PARAMS[::-1]),  # order
        (2, [PARAMS[0], ("2.weight", (40, 24), 0, (480, 480))]),  # shape
        (2, [PARAMS[0], ("2.weight", (24, 40), 1, (480, 480))]),  # owner
        (2, [PARAMS[0], ("2.weight", (24, 40), 0, (481, 479))]),  # elements on each rank
        (2, [PARAMS[0], ("2.bias", (24, 40), 0, (480, 480))]),  # name
    ]
    assert len({base, *(digest(c) for c in changed)}) == len(changed) + 1
