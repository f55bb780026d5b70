"""``python -m benchmarks SCENARIO --preset P --contenders A,B --repeats K [scenario options]``.

Runs one scenario (``benchmarks/scenarios/SCENARIO.py``), prints its table and ratios, and writes
``docs/bench/SCENARIO_PRESET[_VARIANT].json`` with the plot beside it (``--out`` elsewhere). See
``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
from pathlib import Path
from types import ModuleType

from .report import DOCS_BENCH, compute_ratios, fmt, machine_info, table, utc_now, write
from .scenarios import SCENARIOS
from .schema import Report


def scenario_module(name: str) -> ModuleType:
    return importlib.import_module(f".scenarios.{name}", __package__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="scenario", required=True, metavar="SCENARIO")
    for name in SCENARIOS:
        mod = scenario_module(name)
        p = sub.add_parser(name, help=mod.__doc__.splitlines()[0], description=mod.__doc__)
        p.formatter_class = argparse.RawDescriptionHelpFormatter
        p.add_argument(
            "--preset", choices=mod.PRESETS, default=mod.PRESETS[0], help=f"default {mod.PRESETS[0]}"
        )
        p.add_argument(
            "--contenders",
            default=",".join(mod.DEFAULT_CONTENDERS),
            help=f"comma list, run in this order (default %(default)s); of: {', '.join(mod.CONTENDERS)}",
        )
        p.add_argument(
            "--repeats", type=int, default=1, help="run everything K times, interleaved (default 1)"
        )
        p.add_argument("--timeout", type=float, default=1800.0, help="seconds one set of ranks may take")
        p.add_argument("--variant", default=None, help="the file name's variant (default: from the options)")
        p.add_argument("--out", type=Path, default=DOCS_BENCH, help="a .json path, or a folder (docs/bench)")
        mod.add_arguments(p)
    return parser


def parse(argv: list[str]) -> tuple[ModuleType, argparse.Namespace, dict, list[str], str]:
    """The scenario, the parsed options, its config, the contenders and the variant (or SystemExit)."""
    args = build_parser().parse_args(argv)
    mod = scenario_module(args.scenario)
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in contenders if c not in mod.CONTENDERS]
    if unknown or not contenders:
        raise SystemExit(
            f"--contenders: unknown {unknown}. HINT: {args.scenario} runs {', '.join(mod.CONTENDERS)}"
        )
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    cfg, variant = mod.configure(args)
    cfg.update(repeats=args.repeats, timeout=args.timeout)
    return mod, args, cfg, contenders, args.variant if args.variant is not None else variant


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    mod, args, cfg, contenders, variant = parse(argv)
    report = Report(
        scenario=args.scenario,
        preset=args.preset,
        variant=variant,
        date=utc_now(),
        command=shlex.join(["python", "-m", "benchmarks", *argv]),
        machine=machine_info(cfg.get("device", "cpu")),
        config=cfg,
        rows=[],
    )
    print(f"{report.command}\n{report.stem}: {', '.join(contenders)}", flush=True)
    report.rows, report.notes = mod.run(cfg, contenders)
    reference = getattr(mod, "REFERENCE", "flatshard")
    pairs = (
        mod.ratio_pairs(report.rows)
        if hasattr(mod, "ratio_pairs")
        else [(reference, r.name) for r in report.rows]
    )
    report.ratios = compute_ratios(report.rows, mod.RATIOS, pairs)
    columns = mod.columns(report.rows) if hasattr(mod, "columns") else mod.COLUMNS
    report.table = table(report.rows, columns, reference)
    report.machine["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    busy = report.machine["loadavg_at_end"][0] - cfg.get("world_size", 1)
    if busy > 0.75 * (os.cpu_count() or 1):
        report.notes.append(
            f"load average {report.machine['loadavg_at_end'][0]}: other processes shared the CPUs"
        )
    files = write(report, args.out, mod.PANELS)
    if hasattr(mod, "extra_text"):  # a page's include (estimate's tables), beside the report
        files.append(files[0].with_suffix(".md"))
        files[-1].write_text(mod.extra_text(report))
    print("\n" + report.table + "\n")
    for pair, ratio in report.ratios.items():
        print(f"{pair}: " + ", ".join(f"{k} {fmt(v, '.3f')}" for k, v in ratio.items() if v is not None))
    for note in report.notes:
        print(f"note: {note}")
    print("wrote " + ", ".join(map(str, files)))
    bad = [r.name for r in report.rows if r.status == "check failed"]
    return 1 if bad or not any(r.ok for r in report.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
