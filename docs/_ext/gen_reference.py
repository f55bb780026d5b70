"""Write ``docs/reference.md``, the API reference, from the docstrings in ``src/flatshard``.

    python docs/_ext/gen_reference.py           # rewrite docs/reference.md
    python docs/_ext/gen_reference.py --check   # exit 1 if docs/reference.md is out of date

The page is plain Markdown, so it reads the same on the repository page and in the built site. For each
object in :data:`SECTIONS`: a heading, the signature (as ``inspect.signature`` reports it, annotations as
written in the source), then the docstring, whose Google-style sections griffe parses. Sphinx roles become
inline code as in the site's griffe extension (``docs/_ext/griffe_roles.py``). A class also gets its public
methods and properties that have a docstring, in source order. ``tests/unit/test_reference_doc.py`` runs
the check and holds :data:`SECTIONS` and :data:`EXCLUDED` to ``flatshard.__all__``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import importlib
import importlib.util
import inspect
import re
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import griffe

ROOT = Path(__file__).resolve().parents[2]
OUTPUT = ROOT / "docs" / "reference.md"
COMMAND = "python docs/_ext/gen_reference.py"
WIDTH = 88  # a signature longer than this gets one parameter per line, as black writes it


class Entry(NamedTuple):
    path: str  # where the object is found; also its anchor (reference.md#flatshard.X)
    heading: str | None = None  # the public name, where it differs from ``path``


SECTIONS: list[tuple[str, list[Entry]]] = [
    (
        "Sharding",
        [
            Entry("flatshard.engine.shard.shard", "flatshard.shard"),
            Entry("flatshard.ShardOptions"),
            Entry("flatshard.ShardingStrategy"),
            Entry("flatshard.BackwardPrefetch"),
            Entry("flatshard.MixedPrecision"),
            Entry("flatshard.CPUOffload"),
            Entry("flatshard.no_sync"),
            Entry("flatshard.set_requires_gradient_sync"),
            Entry("flatshard.set_requires_all_reduce"),
            Entry("flatshard.set_reshard_after_forward"),
            Entry("flatshard.unshard_params"),
            Entry("flatshard.register_forward_method"),
            Entry("flatshard.join"),
            Entry("flatshard.DesyncError"),
            Entry("flatshard.EMA"),
            Entry("flatshard.lightning.ShardedEMA"),
            Entry("flatshard.clip_grad_norm_"),
            Entry("flatshard.is_sharded"),
            Entry("flatshard.original_shapes"),
            Entry("flatshard.register_whole_tensor_optimizer"),
        ],
    ),
    (
        "State",
        [
            Entry("flatshard.get_state_dict"),
            Entry("flatshard.set_state_dict"),
            Entry("flatshard.ParamShard"),
        ],
    ),
    (
        "Checkpoints",
        [
            Entry("flatshard.save_checkpoint"),
            Entry("flatshard.load_checkpoint"),
            Entry("flatshard.consolidate"),
            Entry("flatshard.checkpoint.export_safetensors"),
            Entry("flatshard.checkpoint.load_safetensors"),
            Entry("flatshard.checkpoint.export.ExportResult"),
            Entry("flatshard.checkpoint.pretrained.load_pretrained", "flatshard.load_pretrained"),
            Entry("flatshard.checkpoint.pretrained.PretrainedLoad"),
            Entry("flatshard.engine.unfilled.UnfilledError", "flatshard.UnfilledError"),
            Entry("flatshard.checkpoint.save_pretrained.save_pretrained", "flatshard.save_pretrained"),
            Entry(
                "flatshard.checkpoint.export_pretrained.export_pretrained",
                "flatshard.checkpoint.export_pretrained",
            ),
            Entry("flatshard.checkpoint.export_pretrained.PretrainedExport"),
            Entry(
                "flatshard.checkpoint.hf_export.parse_max_shard_size",
                "flatshard.checkpoint.parse_max_shard_size",
            ),
            Entry("flatshard.CheckpointError"),
        ],
    ),
    (
        "Lightning",
        [
            Entry("flatshard.FlatShardStrategy"),
            Entry("flatshard.FlatShardFabricStrategy"),
            Entry("flatshard.lightning.precision.FlatShardPrecision"),
            Entry("flatshard.lightning.precision.FlatShardGradScaler"),
            Entry("flatshard.lightning.pretrained.LoadPretrained"),
        ],
    ),
    (
        "Diagnostics",
        [
            Entry("flatshard.engine.transport.comm.timeline"),
            Entry("flatshard.engine.transport.comm.CollectiveTiming"),
            Entry("flatshard.estimate"),
        ],
    ),
]

# Functions and classes of ``flatshard.__all__`` that this page leaves out, each with where it is documented
# instead. Everything else in ``__all__`` must be in SECTIONS (tests/unit/test_reference_doc.py checks).
EXCLUDED: dict[str, str] = {}

INTRO = f"""\
<!-- Generated by `{COMMAND}` from the docstrings in src/flatshard: edit those, then run it. -->

# API reference

Generated from the docstrings in `src/flatshard` by `{COMMAND}`; edit the docstrings, not this page.
A test (`tests/unit/test_reference_doc.py`) fails when this page is out of step with them.

Everything below is importable from `flatshard`
except the precision plugin and grad scaler, which live in `flatshard.lightning.precision`, and the
safetensors exports (`flatshard.checkpoint.export_safetensors`, `load_safetensors`, `export_pretrained`,
`parse_max_shard_size`), in `flatshard.checkpoint`.
`import flatshard` registers the strategy names (`"flatshard"`, `"flatshard_grad_op"`,
`"flatshard_hybrid"`, `"flatshard_offload"`) with the Trainer and Fabric.

Docstrings refer to design notes as `[Note: ...]`; those notes are in the docstrings of the engine
modules under `src/flatshard/engine/`, and [Concepts](concepts.md) explains the same design.
"""


# ---------------------------------------------------------------------------------------------- objects
def resolve(path: str) -> Any:
    """The object at a dotted path: the longest prefix that is a module, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def documented_objects() -> list[Any]:
    """Every object the page documents (not their members)."""
    return [resolve(entry.path) for _, entries in SECTIONS for entry in entries]


def _own_doc(obj: Any) -> str:
    """The object's own docstring (not one inherited), cleaned; roles as inline code."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    return _roles(inspect.cleandoc(doc)) if doc else ""


def _load_roles() -> Callable[[str], str]:
    """The site's griffe extension's role conversion, so that both render roles alike."""
    spec = importlib.util.spec_from_file_location(
        "_griffe_roles", Path(__file__).with_name("griffe_roles.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return lambda text: module._ROLE.sub(module._replace, text)


_roles = _load_roles()


# ---------------------------------------------------------------------------------------------- signatures
_DOTTED = re.compile(r"\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)")
_QUOTED = re.compile(r"('[^']*'|\"[^\"]*\")")


def annotation(value: Any) -> str | None:
    """An annotation as the source writes it: a string as it is (``from __future__ import annotations``);
    an evaluated one with its modules left out (``typing.Any`` as ``Any``)."""
    if value is inspect.Parameter.empty or value is dataclasses.MISSING:
        return None
    if isinstance(value, str):
        return value
    return _type(value)


def _type(value: Any) -> str:
    """An evaluated annotation as source code, the same on every Python version (3.10 spells ``Any | None``
    ``typing.Optional[typing.Any]``): unions with ``|``, classes by name."""
    origin, args = typing.get_origin(value), typing.get_args(value)
    if value is None or value is type(None):
        return "None"
    if value is Ellipsis:
        return "..."
    if value is typing.Any:
        return "Any"
    if isinstance(value, typing.ForwardRef):
        return value.__forward_arg__
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(_type(arg) for arg in args)
    if origin is typing.Literal:
        return f"Literal[{', '.join(literal(arg) for arg in args)}]"
    if origin is not None and args:
        name = _unqualified(getattr(origin, "__name__", None) or repr(origin))
        if name == "Callable" and len(args) == 2 and isinstance(args[0], list):
            return f"Callable[[{', '.join(_type(arg) for arg in args[0])}], {_type(args[1])}]"
        return f"{name}[{', '.join(_type(arg) for arg in args)}]"
    if isinstance(value, type):
        return value.__qualname__
    return _unqualified(repr(value))


def _unqualified(text: str) -> str:
    """``typing.Any`` as ``Any``, ``Literal['a']`` as ``Literal["a"]`` (black's quotes); the text inside
    quotes kept as it is."""
    out = []
    for i, part in enumerate(_QUOTED.split(text)):
        if not i % 2:
            out.append(_DOTTED.sub(r"\1", part))
        elif part.startswith("'") and '"' not in part and "\\" not in part:
            out.append(f'"{part[1:-1]}"')
        else:
            out.append(part)
    return "".join(out)


def literal(value: Any) -> str:
    """A default value as source code; refuses anything whose repr would change from run to run."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, str) and '"' not in value and "\\" not in value:
        return f'"{value}"'
    text = repr(value)
    if " at 0x" in text:
        raise ValueError(f"default {text} has no stable spelling: give {COMMAND} one")
    return _unqualified(text)  # datetime.timedelta(seconds=1800) as timedelta(seconds=1800)


def _parameter(p: inspect.Parameter) -> str:
    name = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
    ann = annotation(p.annotation)
    if p.default is p.empty:
        return f"{name}: {ann}" if ann else name
    return f"{name}: {ann} = {literal(p.default)}" if ann else f"{name}={literal(p.default)}"


def _parameters(sig: inspect.Signature) -> list[str]:
    params = list(sig.parameters.values())
    out: list[str] = []
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and (
            i == 0 or params[i - 1].kind not in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
        ):
            out.append("*")
        out.append(_parameter(p))
        if p.kind is p.POSITIONAL_ONLY and (
            i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY
        ):
            out.append("/")
    return out


def layout(name: str, params: list[str], returns: str | None = None) -> str:
    """``name(params) -> returns`` on one line if it fits, else one parameter per line (black's way)."""
    tail = f" -> {returns}" if returns else ""
    line = f"{name}({', '.join(params)}){tail}"
    if len(line) <= WIDTH or not params:
        return line
    return f"{name}(\n" + "".join(f"    {p},\n" for p in params) + f"){tail}"


def _signature(obj: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):
        return None


def function_signature(name: str, fn: Callable[..., Any], *, drop_first: bool = False) -> str:
    sig = inspect.signature(fn)
    if drop_first:
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    prefix = "async " if inspect.iscoroutinefunction(fn) else ""
    return prefix + layout(name, _parameters(sig), annotation(sig.return_annotation))


def _bases(cls: type) -> list[str]:
    return [b.__name__ for b in cls.__bases__ if b is not object]


def _has_python_init(cls: type) -> bool:
    """Whether a class of Python code (not ``object`` or a builtin like ``RuntimeError``) defines
    ``__init__`` or ``__new__`` for ``cls``."""
    for klass in cls.__mro__:
        if klass.__module__ == "builtins":
            continue
        if "__init__" in klass.__dict__ or "__new__" in klass.__dict__:
            return True
    return False


def class_signature(cls: type) -> str:
    """A dataclass, enum or TypedDict as its class body; an exception without an ``__init__`` of its own as
    its class line; any other class as its call signature (``__init__``'s, without ``self``)."""
    bases = _bases(cls)
    header = f"class {cls.__name__}" + (f"({', '.join(bases)})" if bases else "")
    if dataclasses.is_dataclass(cls):
        params = cls.__dataclass_params__  # type: ignore[attr-defined]
        flags = [
            f"{flag}={getattr(params, flag)}"
            for flag, default in (
                ("init", True),
                ("repr", True),
                ("eq", True),
                ("order", False),
                ("frozen", False),
            )
            if getattr(params, flag) != default
        ]
        lines = ["@dataclass" + (f"({', '.join(flags)})" if flags else ""), header + ":"]
        for f in dataclasses.fields(cls):
            line = f"    {f.name}: {annotation(f.type)}"
            if f.default is not dataclasses.MISSING:
                line += f" = {literal(f.default)}"
            elif f.default_factory is not dataclasses.MISSING:
                factory = getattr(f.default_factory, "__name__", "...")
                line += f" = field(default_factory={factory if factory != '<lambda>' else '...'})"
            lines.append(line)
        return "\n".join(lines)
    if isinstance(cls, enum.EnumMeta):
        members = cls.__members__.items()  # type: ignore[var-annotated]
        return "\n".join([header + ":", *(f"    {name} = {literal(m.value)}" for name, m in members)])
    if typing.is_typeddict(cls):
        total = "" if cls.__total__ else ", total=False"  # type: ignore[attr-defined]
        hints = cls.__annotations__
        return "\n".join(
            [
                f"class {cls.__name__}(TypedDict{total}):",
                *(f"    {k}: {annotation(v)}" for k, v in hints.items()),
            ]
        )
    sig = _signature(cls)
    if sig is None or not _has_python_init(cls):
        return header
    return layout(cls.__name__, _parameters(sig))


# ---------------------------------------------------------------------------------------------- docstrings
_DOUBLE_TICKS = re.compile(r"``([^`]+?)``")


def _ticks(text: str) -> str:
    """reST's ````code```` as Markdown's ```code```."""
    return _DOUBLE_TICKS.sub(lambda m: f"`{m.group(1)}`", text)


def markdown_text(text: str) -> str:
    """Docstring prose as Markdown: a reST literal block (a paragraph ending ``::``, then an indented block)
    becomes a fenced code block; other indented lines after a blank line are indented no more than a list
    item's text, so they never become code blocks by accident."""
    lines = _ticks(text).split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.rstrip().endswith("::") and not line.lstrip().startswith("```"):
            j = i
            while j < len(lines) and not lines[j].strip():
                j += 1
            base = len(line) - len(line.lstrip())
            if j < len(lines) and len(lines[j]) - len(lines[j].lstrip()) > base:
                block: list[str] = []
                while j < len(lines) and (
                    not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > base
                ):
                    block.append(lines[j])
                    j += 1
                while block and not block[-1].strip():
                    block.pop()
                head = line.rstrip()[:-1]
                if head.strip() != ":":
                    out.append(head)
                out += ["", "```python", *textwrap.dedent("\n".join(block)).split("\n"), "```", ""]
                i = j
                continue
        if out and not out[-1].strip() and len(line) - len(line.lstrip()) >= 4:
            line = "  " + line.lstrip()
        out.append(line)
    return "\n".join(out).strip("\n")


def _indent(text: str) -> str:
    """A list item's text: lines after the first indented under it."""
    first, *rest = text.split("\n")
    return "\n".join([first, *(f"    {line}" if line.strip() else "" for line in rest)])


def _item(name: str | None, type_: str | None, description: str) -> str:
    """``- `name` (`type`): description``; a nameless one (a return value) ``- `type`: description``."""
    if name:
        head = f"`{name}`" + (f" (`{type_}`)" if type_ else "")
    else:
        head = f"`{type_}`" if type_ else ""
    body = markdown_text(description)
    if not head:
        return "- " + _indent(body)
    return f"- {head}" + (": " + _indent(body) if body else "")


def _str(value: Any) -> str | None:
    return None if value is None else str(value)


def render_docstring(text: str, known_types: dict[str, str], returns: str | None) -> str:
    """A docstring's Google-style sections as Markdown. ``known_types``: parameter and attribute types from
    the signature (used where the docstring names none); ``returns``: the return annotation."""
    if not text:
        return ""
    sections = griffe.Docstring(text).parse("google", warn_missing_types=False, warn_unknown_params=False)
    titles = {
        "parameters": "Parameters",
        "other_parameters": "Keyword arguments",
        "attributes": "Attributes",
        "raises": "Raises",
        "warns": "Warns",
        "returns": "Returns",
        "yields": "Yields",
        "receives": "Receives",
    }
    blocks: list[str] = []
    for section in sections:
        kind = section.kind.name
        if kind == "text":
            blocks.append(markdown_text(section.value))
        elif kind in ("parameters", "other_parameters", "attributes"):
            items = [
                _item(p.name, _str(p.annotation) or known_types.get(p.name.lstrip("*")), p.description)
                for p in section.value
            ]
            blocks.append(f"**{titles[kind]}:**\n\n" + "\n".join(items))
        elif kind in ("raises", "warns"):
            items = [_item(_str(r.annotation), None, r.description) for r in section.value]
            blocks.append(f"**{titles[kind]}:**\n\n" + "\n".join(items))
        elif kind in ("returns", "yields", "receives"):
            values = section.value
            items = [
                _item(
                    r.name or None,
                    _str(r.annotation) or (returns if kind == "returns" and len(values) == 1 else None),
                    r.description,
                )
                for r in values
            ]
            blocks.append(f"**{titles[kind]}:**\n\n" + "\n".join(items))
        elif kind == "examples":
            parts = ["**Examples:**"]
            for sub_kind, sub_text in section.value:
                if sub_kind.name == "examples":
                    parts.append(f"```pycon\n{sub_text}\n```")
                else:
                    parts.append(markdown_text(sub_text))
            blocks.append("\n\n".join(parts))
        elif kind == "admonition":
            title = section.title or section.value.annotation.title()
            body = markdown_text(section.value.description)
            quoted = "\n".join(f"> {line}" if line else ">" for line in body.split("\n"))
            blocks.append(f"> **{title}:**\n>\n{quoted}")
        elif kind == "deprecated":
            blocks.append(
                f"**Deprecated** since {section.value.version}: {markdown_text(section.value.description)}"
            )
        else:
            raise ValueError(f"docstring section {kind!r} has no rendering in {COMMAND}")
    return "\n\n".join(b for b in blocks if b)


def _types(obj: Any) -> dict[str, str]:
    """Types of a callable's parameters, or of a class's fields and ``__init__`` parameters."""
    out: dict[str, str] = {}
    if inspect.isclass(obj):
        for klass in reversed(obj.__mro__):
            for name, value in inspect.get_annotations(klass).items():
                if (text := annotation(value)) is not None:
                    out[name] = text
    sig = _signature(obj)
    if sig is not None:
        for p in sig.parameters.values():
            if (text := annotation(p.annotation)) is not None:
                out[p.name] = text
    return out


# ---------------------------------------------------------------------------------------------- the page
def _code(text: str) -> str:
    return f"```python\n{text}\n```"


def _heading(level: int, anchor: str, title: str) -> str:
    # an explicit anchor, the object's path: other pages link to reference.md#flatshard.X
    return f'<a id="{anchor}"></a>\n\n{"#" * level} {title}'


def members(cls: type) -> Iterator[tuple[str, str, Any]]:
    """``(name, kind, object)`` of the public methods and properties ``cls`` defines with a docstring, in
    source order; names starting with ``_`` and members without a docstring are left out."""
    for name, value in cls.__dict__.items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            kind, fn = "property", value.fget
        elif isinstance(value, classmethod):
            kind, fn = "classmethod", value.__func__
        elif isinstance(value, staticmethod):
            kind, fn = "staticmethod", value.__func__
        elif inspect.isfunction(value):
            kind, fn = "method", value
        else:
            continue
        if fn is not None and fn.__doc__:
            yield name, kind, fn


def render_member(owner: str, anchor: str, name: str, kind: str, fn: Callable[..., Any]) -> str:
    if kind == "property":
        sig = inspect.signature(fn)
        ann = annotation(sig.return_annotation)
        code = f"{name}: {ann}" if ann else name
        returns = None
    else:
        code = function_signature(name, fn, drop_first=kind != "staticmethod")
        returns = annotation(inspect.signature(fn).return_annotation)
    title = f"{owner}.{name}" + ("" if kind == "method" else f" ({kind})")
    parts = [_heading(4, f"{anchor}.{name}", title), _code(code)]
    doc = render_docstring(_own_doc(fn), _types(fn), returns)
    if doc:
        parts.append(doc)
    return "\n\n".join(parts)


def render_entry(entry: Entry) -> str:
    obj = resolve(entry.path)
    title = entry.heading or entry.path
    parts = [_heading(3, entry.path, title)]
    if inspect.isclass(obj):
        code = class_signature(obj)
        parts.append(_code(code))
        if not code.startswith(("class ", "@dataclass")) and _bases(obj):
            parts.append("Bases: " + ", ".join(f"`{b}`" for b in _bases(obj)))
        returns = None
    else:
        parts.append(_code(function_signature(obj.__name__, obj)))
        returns = annotation(inspect.signature(obj).return_annotation)
    doc = render_docstring(_own_doc(obj), _types(obj), returns)
    if doc:
        parts.append(doc)
    if inspect.isclass(obj):
        parts += [render_member(title, entry.path, *member) for member in members(obj)]
    return "\n\n".join(parts)


def render() -> str:
    blocks = [INTRO.rstrip("\n")]
    for title, entries in SECTIONS:
        blocks.append(f"## {title}")
        blocks += [render_entry(entry) for entry in entries]
    return "\n\n".join(blocks) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/reference.md is out of date")
    args = parser.parse_args(argv)
    if str(ROOT / "src") not in sys.path:
        sys.path.insert(0, str(ROOT / "src"))
    text = render()
    current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
    if args.check:
        if text == current:
            return 0
        diff = difflib.unified_diff(
            current.splitlines(), text.splitlines(), "docs/reference.md", "generated", lineterm="", n=1
        )
        shown = list(diff)[:40]
        print("\n".join(shown), file=sys.stderr)
        print(f"docs/reference.md is out of date with the docstrings: run `{COMMAND}`.", file=sys.stderr)
        return 1
    if text != current:
        OUTPUT.write_text(text, encoding="utf-8")
        print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
