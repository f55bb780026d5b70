"""The package's layout rules, read from the source: one-way imports, the engine's declared contract, no
private names across packages, files under 800 lines, ``checkpoint/__init__.py`` only re-exporting."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import flatshard

ROOT = Path(flatshard.__file__).parent
MAX_LINES = 800


def _module_name(path: Path) -> str:
    parts = ["flatshard", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str) -> list[tuple[str, list[str], int]]:
    """``(imported module, names taken from it, line)`` for every flatshard import in ``name``, at any depth
    (imports inside functions count: they run too)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("flatshard")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], base]
                ).strip(".")
            if base.startswith("flatshard"):
                out.append((base, [a.name for a in node.names], node.lineno))
    return out


def _edges(name: str) -> set[str]:
    """Modules ``name`` imports: ``from pkg import sub`` names the submodule when ``pkg.sub`` is one."""
    out = set()
    for module, names, _ in _imports(name):
        subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
        out.update(subs)
        if len(subs) < len(names) or not names:
            out.add(module)
    return out & set(MODULES)


def _cycle() -> list[str] | None:
    graph = {m: sorted(_edges(m)) for m in MODULES}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in graph[m]:
            if state.get(n) == 1:
                return [*stack[stack.index(n) :], n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in graph:
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle() -> None:
    assert _cycle() is None, " -> ".join(_cycle() or [])


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_outside_the_engine_only_its_contract_is_imported() -> None:
    bad = [
        f"{m}:{line} imports {module}"
        for m in MODULES
        if not _in(m, "flatshard.engine")
        for module, _, line in _imports(m)
        if _in(module, "flatshard.engine") and module != "flatshard.engine"
    ]
    assert not bad, bad


def test_the_contract_exports_every_name_used_outside_the_engine() -> None:
    import flatshard.engine

    missing = [
        f"{m}: {n}"
        for m in MODULES
        if not _in(m, "flatshard.engine")
        for module, names, _ in _imports(m)
        if module == "flatshard.engine"
        for n in names
        if n not in flatshard.engine.__all__
    ]
    assert not missing, missing


def test_outside_checkpoint_only_its_contract_is_imported() -> None:
    import flatshard.checkpoint

    bad = [
        f"{m}:{line} imports {module}"
        for m in MODULES
        if not _in(m, "flatshard.checkpoint")
        for module, _, line in _imports(m)
        if _in(module, "flatshard.checkpoint") and module != "flatshard.checkpoint"
    ]
    missing = [
        f"{m}: {n}"
        for m in MODULES
        if not _in(m, "flatshard.checkpoint")
        for module, names, _ in _imports(m)
        if module == "flatshard.checkpoint"
        for n in names
        if n not in flatshard.checkpoint.__all__
    ]
    assert not bad and not missing, bad + missing


def test_transport_imports_nothing_else_of_the_engine() -> None:
    bad = [
        f"{m}:{line} imports {module}"
        for m in MODULES
        if _in(m, "flatshard.engine.transport")
        for module, _, line in _imports(m)
        if _in(module, "flatshard.engine") and not _in(module, "flatshard.engine.transport")
    ]
    assert not bad, bad


def _package(name: str) -> str:
    """``flatshard.engine``, ``flatshard.checkpoint``, ... (a top-level module is a package of its own)."""
    return ".".join(name.split(".")[:2])


def test_no_private_name_is_imported_across_packages() -> None:
    bad = [
        f"{m}:{line} takes {n} from {module}"
        for m in MODULES
        for module, names, line in _imports(m)
        if _package(module) != _package(m)
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert not bad, bad


@pytest.mark.parametrize("name", sorted(MODULES))
def test_files_stay_under_the_size_limit(name: str) -> None:
    lines = MODULES[name].read_text().count("\n")
    assert lines <= MAX_LINES, f"{MODULES[name]} has {lines} lines (limit {MAX_LINES}): split it by concept"


def test_checkpoint_init_only_reexports() -> None:
    tree = ast.parse(MODULES["flatshard.checkpoint"].read_text())
    logic = [
        type(node).__name__
        for node in tree.body
        if not isinstance(node, (ast.Import, ast.ImportFrom))
        and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))  # docstring
        and not (isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["__all__"])
    ]
    assert not logic, logic
