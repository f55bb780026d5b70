"""docs/reference.md is generated from the docstrings (docs/_ext/gen_reference.py): it is up to date, and it
documents every public function and class of ``flatshard`` but the few its generator excludes, with why."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("griffe")

import flatshard

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "docs" / "_ext" / "gen_reference.py"


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_is_up_to_date(gen: ModuleType) -> None:
    current = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    assert gen.render() == current, (
        "docs/reference.md is out of date with the docstrings: run `python docs/_ext/gen_reference.py` "
        "(`--check` shows the difference)."
    )


def _public_api() -> dict[str, object]:
    """The functions and classes in ``flatshard.__all__``."""
    objects = {name: getattr(flatshard, name) for name in flatshard.__all__}
    return {name: obj for name, obj in objects.items() if inspect.isfunction(obj) or inspect.isclass(obj)}


def test_every_public_name_is_documented_or_excluded(gen: ModuleType) -> None:
    documented = gen.documented_objects()
    missing = [
        name
        for name, obj in _public_api().items()
        if name not in gen.EXCLUDED and not any(obj is d for d in documented)
    ]
    assert not missing, (
        f"flatshard.__all__ has {missing}, which docs/reference.md does not document: add each to SECTIONS "
        "in docs/_ext/gen_reference.py (or to EXCLUDED, with why), then run `python docs/_ext/gen_reference.py`."
    )


def test_exclusions_are_current(gen: ModuleType) -> None:
    api = _public_api()
    documented = gen.documented_objects()
    stale = [name for name in gen.EXCLUDED if name not in api or any(api[name] is d for d in documented)]
    assert not stale, (
        f"EXCLUDED in docs/_ext/gen_reference.py names {stale}: public API no more, or documented."
    )
    assert all(why.strip() for why in gen.EXCLUDED.values()), "every exclusion says why"
