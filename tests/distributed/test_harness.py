"""The rank launcher the tests use: both start methods run ranks in the caller's current environment."""

from __future__ import annotations

import os

import pytest

from flatshard.testing import spawn


def _read_env(rank: int, world: int) -> tuple[str | None, str | None]:
    return os.environ.get("FLATSHARD_HARNESS_PROBE"), os.environ.get("RANK")


@pytest.mark.parametrize("method", [pytest.param("spawn", marks=pytest.mark.slow), "forkserver"])
def test_ranks_see_the_callers_environment(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spawn(_read_env, 2, start_method=method)  # the forkserver (if any) starts before the variable is set
    monkeypatch.setenv("FLATSHARD_HARNESS_PROBE", method)
    assert spawn(_read_env, 2, start_method=method) == [(method, "0"), (method, "1")]


def test_an_unknown_start_method_is_refused() -> None:
    with pytest.raises(ValueError, match="use 'spawn' or 'forkserver'"):
        spawn(_read_env, 1, start_method="fork")
