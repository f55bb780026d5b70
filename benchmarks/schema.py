"""The one JSON schema every scenario writes: a :class:`Report` of :class:`Row` s, and the file naming scheme.

A file is ``docs/bench/SCENARIO_PRESET[_VARIANT].json`` (the plot beside it, ``.png``): the scenario, the preset,
and, when an option changes what is measured, a variant made of those options (``lora8``, ``muon``, ``w4``...).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

SCHEMA_VERSION = 1
STATUSES = ("ok", "failed", "check failed")
_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]*$")


@dataclass
class Row:
    """One line of a scenario's table.

    ``name`` is unique in the report: the contender (a registry name), and for an extra row its ``label``
    (``"flatshard warm gather"``). ``metrics`` hold the numbers the table and ratios use, each key ending in its
    unit (``step_s``, ``peak_rss_mib``; a list is per rank); ``runs`` the raw data, per repeat and rank.
    ``check`` says whether this contender's output agreed with the reference before anything was compared:
    ``{"ok": bool | None, "against": row name, ...}``; ``status`` is ``"check failed"`` when it did not.
    """

    name: str
    contender: str
    label: str = ""
    status: str = "ok"
    metrics: dict[str, Any] = field(default_factory=dict)
    check: dict[str, Any] = field(default_factory=dict)
    runs: list[Any] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class Report:
    """What one ``python -m benchmarks SCENARIO ...`` run measured, with when, where and how."""

    scenario: str
    preset: str
    variant: str
    date: str  # UTC, ISO 8601
    command: str  # the exact command line that reproduces it
    machine: dict[str, Any]
    config: dict[str, Any]
    rows: list[Row]
    ratios: dict[str, dict[str, float | None]] = field(default_factory=dict)  # "a ÷ b" -> metric -> a / b
    notes: list[str] = field(default_factory=list)
    table: str = ""  # the printed Markdown table
    schema: int = SCHEMA_VERSION

    @property
    def stem(self) -> str:
        """The file name without its suffix: ``SCENARIO_PRESET[_VARIANT]``."""
        return file_stem(self.scenario, self.preset, self.variant)

    def row(self, name: str) -> Row:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"no row {name!r} in {self.stem}; rows: {[r.name for r in self.rows]}")

    def to_json(self) -> str:
        self.validate()
        return json.dumps(asdict(self), indent=1, default=str) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Report:
        data = json.loads(text)
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"not a benchmark report: unknown keys {sorted(unknown)}")
        report = cls(**{**data, "rows": [Row(**r) for r in data.get("rows", [])]})
        report.validate()
        return report

    def validate(self) -> None:
        """Raise ``ValueError`` listing everything that does not follow the schema."""
        bad = []
        if self.schema != SCHEMA_VERSION:
            bad.append(f"schema {self.schema} (this code reads {SCHEMA_VERSION})")
        for key in ("scenario", "preset"):
            if not _NAME.match(getattr(self, key).replace("_", "-")):
                bad.append(f"{key} {getattr(self, key)!r} (lower case, digits, '-', '.', '_')")
        if self.variant and not _NAME.match(self.variant.replace("_", "-")):  # parts joined by "_"
            bad.append(f"variant {self.variant!r} (lower case, digits, '-', '.', '_')")
        for key in ("date", "command"):
            if not getattr(self, key):
                bad.append(f"{key} is empty")
        names = [r.name for r in self.rows]
        if len(set(names)) != len(names):
            bad.append(f"row names repeat: {names}")
        for r in self.rows:
            if r.status not in STATUSES:
                bad.append(f"row {r.name!r}: status {r.status!r} not in {STATUSES}")
            if r.status == "failed" and not r.error:
                bad.append(f"row {r.name!r} failed without an error")
        for pair in self.ratios:
            a, _, b = pair.partition(" ÷ ")
            if a not in names or b not in names:
                bad.append(f"ratio {pair!r} names a row that is not in the report")
        if bad:
            raise ValueError("benchmark report does not follow the schema: " + "; ".join(bad))


def file_stem(scenario: str, preset: str, variant: str = "") -> str:
    return f"{scenario}_{preset}" + (f"_{variant}" if variant else "")
