"""Every option is described once and taken by both strategies under the same name (see [Note: options
described once]): the signatures, the generated docstrings and the guide's table follow the option records."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

import flatshard
from flatshard.engine import ShardOptions
from flatshard.lightning.options import (
    SHELL_ARGUMENTS,
    StrategyOptions,
    document_strategy,
    option_docs,
    options_table,
    strategy_option_names,
)
from flatshard.lightning.options import table_in as guide_table

STRATEGIES = [flatshard.FlatShardStrategy, flatshard.FlatShardFabricStrategy]
FABRIC_OMITS = {"grad_accumulation"}
GUIDE = Path(__file__).parents[2] / "docs" / "guide.md"


def _params(cls: type) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(cls).parameters)


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: c.__name__)
def test_every_option_is_an_argument_of_both_strategies(cls: type) -> None:
    params = _params(cls)
    wanted = [
        n
        for n in strategy_option_names()
        if not (cls is flatshard.FlatShardFabricStrategy and n in FABRIC_OMITS)
    ]
    assert [n for n in wanted if n not in params] == []
    assert [n for n in params if n not in wanted and n not in SHELL_ARGUMENTS] == []  # no stray argument


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: c.__name__)
def test_a_strategy_default_means_the_option_default(cls: type) -> None:
    params = _params(cls)
    engine = {f.name for f in dataclasses.fields(ShardOptions)}
    for name in strategy_option_names():
        if name not in params:
            continue
        default = params[name].default
        if name in engine:
            assert getattr(ShardOptions(**{name: default}), name) == getattr(ShardOptions(), name), name
        else:
            assert getattr(StrategyOptions(**{name: default}), name) == getattr(StrategyOptions(), name), name


def test_every_option_and_argument_has_one_description() -> None:
    docs = option_docs()
    assert set(docs) == {*ShardOptions.field_names(), *strategy_option_names()}
    assert all(len(text) > 20 for text in docs.values()), docs
    for cls in STRATEGIES:
        doc = inspect.cleandoc(cls.__doc__ or "")
        for name in _params(cls):
            first_words = " ".join((docs.get(name) or SHELL_ARGUMENTS[name]).split()[:6])
            assert f"    {name}: " in doc and first_words in " ".join(doc.split()), (cls.__name__, name)


def test_an_undescribed_argument_fails_at_import() -> None:
    class Shell:
        def __init__(self, sharding_strategy: str = "FULL_SHARD", undocumented: int = 0) -> None:
            """A strategy shell with an argument nobody described."""

    with pytest.raises(TypeError, match="no description for undocumented"):
        document_strategy(Shell)


def test_an_argument_that_is_not_an_option_is_refused() -> None:
    with pytest.raises(TypeError, match="forward_prefech is not an option"):
        StrategyOptions.from_arguments({"self": object(), "timeout": None, "forward_prefech": True})


def test_the_guide_table_is_generated_from_the_descriptions() -> None:
    found = guide_table(GUIDE.read_text())
    assert found is not None, "docs/guide.md lost its generated option table"
    assert found == options_table(), (
        "stale: run `python -m flatshard.lightning.options --write docs/guide.md`"
    )


def test_a_name_a_strategy_does_not_take_is_refused_with_its_hint() -> None:
    with pytest.raises(TypeError, match="did you mean forward_prefetch"):
        flatshard.FlatShardStrategy(forward_prefech=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="grad_accumulation: a Fabric loop chooses per backward"):
        flatshard.FlatShardFabricStrategy(grad_accumulation="no_sync")  # type: ignore[call-arg]


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: c.__name__)
def test_the_options_are_keywords_typed_once(cls: type) -> None:
    """Every option is keyword-only, with a resolved type (LightningCLI parses YAML values into it)."""
    params = _params(cls)
    for name in strategy_option_names():
        if name in params:
            assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
            assert not isinstance(params[name].annotation, str), name


def test_an_option_without_an_argument_type_fails_at_import() -> None:
    from typing_extensions import TypedDict

    from flatshard.lightning.options import takes_options

    class Partial(TypedDict, total=False):
        sharding_strategy: str

    class Shell:
        def __init__(self, timeout: object = None, **options: object) -> None:
            """A strategy shell whose argument types miss most options."""

    with pytest.raises(TypeError, match="has no argument type in Partial"):
        takes_options(Partial)(Shell)


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: c.__name__)
def test_positional_arguments_mirror_lightnings_fsdp_strategy(cls: type) -> None:
    """A positional call that works with Lightning's ``FSDPStrategy`` means the same with flatshard's."""
    if cls is flatshard.FlatShardStrategy:
        from lightning.pytorch.strategies import FSDPStrategy
    else:
        from lightning.fabric.strategies import FSDPStrategy
    theirs = list(inspect.signature(FSDPStrategy).parameters)
    theirs = theirs[: theirs.index("timeout") + 1]
    assert list(_params(cls))[: len(theirs)] == theirs
