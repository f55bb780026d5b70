"""``log_once``: one line per key and logger in a process."""

from __future__ import annotations

import logging

import pytest

from flatshard.engine.log_once import log_once


def test_a_key_logs_once_per_logger(caplog: pytest.LogCaptureFixture) -> None:
    first, second = (
        logging.getLogger("flatshard.test_log_once.a"),
        logging.getLogger("flatshard.test_log_once.b"),
    )
    with caplog.at_level(logging.INFO):
        assert log_once(first, ("k", 1), "value %d", 1)
        assert not log_once(first, ("k", 1), "value %d", 2)  # the same key: nothing
        assert log_once(first, ("k", 2), "value %d", 3)
        assert log_once(second, ("k", 1), "value %d", 4)  # another logger keeps its own keys
        assert log_once(first, "warned", "careful", level=logging.WARNING)
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        (first.name, logging.INFO, "value 1"),
        (first.name, logging.INFO, "value 3"),
        (second.name, logging.INFO, "value 4"),
        (first.name, logging.WARNING, "careful"),
    ]
