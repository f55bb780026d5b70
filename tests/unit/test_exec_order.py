"""Execution-order record used for prefetching."""

from __future__ import annotations

import pytest

from flatshard.engine.exec_order import ExecOrder


def _forward(order: ExecOrder[str], pre: list[str], post: list[str]) -> None:
    order.begin_forward()
    for u in pre:
        order.note_pre_forward(u)
    for u in post:
        order.note_post_forward(u)
    order.finish_forward()


def test_first_iteration_records_then_predicts() -> None:
    order: ExecOrder[str] = ExecOrder()
    assert order.next_forward("root") is None  # nothing recorded yet
    _forward(order, ["root", "b0", "b1", "b2"], ["b0", "b1", "b2", "root"])
    assert [order.next_forward(u) for u in ("root", "b0", "b1", "b2")] == ["b0", "b1", "b2", None]
    # backward runs in the reverse of post-forward order: root, b2, b1, b0
    assert [order.next_backward(u) for u in ("root", "b2", "b1", "b0")] == ["b2", "b1", "b0", None]


def test_changed_order_warns_once_and_disables_prefetch() -> None:
    order: ExecOrder[str] = ExecOrder()
    _forward(order, ["root", "b0", "b1"], ["b0", "b1", "root"])
    with pytest.warns(UserWarning, match="order of unit forwards changed"):
        _forward(order, ["root", "b1", "b0"], ["b1", "b0", "root"])
    assert not order.valid and order.next_forward("root") is None and order.next_backward("root") is None


def test_fewer_units_than_recorded_is_a_change() -> None:
    order: ExecOrder[str] = ExecOrder()
    _forward(order, ["root", "b0", "b1"], ["b0", "b1", "root"])
    with pytest.warns(UserWarning):
        _forward(order, ["root", "b0"], ["b0", "root"])
    assert not order.valid
