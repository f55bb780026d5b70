"""One command that checks flatshard on a GPU machine and writes one JSON summary.

    PYTHONPATH=src python benchmarks/gpu_check.py OUT_DIR

Runs, in this order, each part in a subprocess of its own (its output in ``OUT_DIR/<part>.log``), within a
time budget (``--budget-s``, default 570 s, so the whole check ends within 10 minutes):

1. ``parity``: ``gpu_check_worker.py --device cuda``: two ranks on one GPU over gloo, FULL_SHARD with
   forward and backward prefetch, the all-gather limiter, CPU offload and float16 mixed precision
   (autocast + ``FlatShardGradScaler``, what ``precision="16-mixed"`` does), against an unsharded
   single-process reference: weights and losses must agree, and the limiter must have engaged.
2. ``sanitizer``: the same, two steps, under ``TORCH_CUDA_SANITIZER=1``: torch's CUDA sanitizer reports any
   kernel that reads or writes a tensor another stream may still be using (a stream-ordering race) and
   fails the run.
3. ``pytest_gpu``: ``python -m pytest -m gpu tests/gpu`` (NCCL tests need a GPU per rank; the others run two
   ranks on GPU 0 over gloo when there is only one GPU).
4. ``step_time``: ``python -m benchmarks train --preset cuda-1b`` against FSDP1, FSDP2 and DDP, one rank per GPU. With one
   GPU that is a single-rank comparison (compute and memory overheads, no communication), recorded as such;
   with tokens/s, MFU (torchtitan's FLOPs-per-token formula against the card's dense bf16 peak) and the
   allocator's peak per phase of one extra step.
5. ``float8_compile``: ``python -m benchmarks train --preset cuda-1b --world-size 1`` with flatshard and FSDP2
   eager, each ``Block`` compiled, and compiled with torchao's float8 training (tensorwise, float8 all-gathers):
   tokens/s, MFU (float8 rows against the same bf16 peak) and peak allocated memory, the float8 rows' losses
   checked against each other. Without torchao only the eager and compiled rows run (a warning says so).
6. ``step_time_gloo``: the same contenders as ``step_time`` as two processes on GPU 0 over gloo (a smaller GPT:
   gloo moves CUDA tensors through host memory), so the streams, events and limiter run with real
   communication on a single GPU. A peer that cannot run over gloo with CUDA tensors is recorded as failed, as a
   warning.

The summary, ``OUT_DIR/gpu_check.json``, has each part's status (``passed`` / ``failed`` / ``skipped`` with a
reason), duration and numbers, plus the versions (Python, torch, CUDA, cuDNN, NCCL, driver, GPUs, Lightning,
flatshard's git commit). Exit status 1 if a part failed, else 0.

Without CUDA it prints so, writes the JSON with the status ``skipped: no CUDA`` and exits 0. ``--rehearse-cpu``
instead runs the benchmark parts (``step_time``, ``float8_compile``) on the CPU with the ``tiny`` preset, so that
their commands and the reading of their results are tried before a GPU is at hand; the numbers mean nothing.

Every part runs flatshard from this tree (``src/`` is put first on the subprocesses' ``PYTHONPATH``) with the
torch already installed: nothing is installed or upgraded. A torch older than the tested floor in
``pyproject.toml`` gets a warning, and the check runs anyway.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: the suite's package is beside it
    sys.path.insert(0, str(REPO))

from benchmarks.report import git_commit  # noqa: E402

PARTS = ("parity", "sanitizer", "pytest_gpu", "step_time", "float8_compile", "step_time_gloo")
BENCH_PARTS = ("step_time", "float8_compile", "step_time_gloo")
# The longest each part may take (seconds), and the least time worth starting it with.
CAPS = {
    "parity": 180,
    "sanitizer": 240,
    "pytest_gpu": 330,
    "step_time": 300,
    "float8_compile": 360,
    "step_time_gloo": 200,
}
MIN_START = {
    "parity": 30,
    "sanitizer": 30,
    "pytest_gpu": 60,
    "step_time": 90,
    "float8_compile": 150,
    "step_time_gloo": 60,
}
# float8_compile: eager, compiled, compiled + float8; flatshard beside FSDP2 (+ torchao), one rank.
COMPILE_CONTENDERS = ("flatshard", "fsdp2", "flatshard_compiled", "fsdp2_compiled")
FLOAT8_CONTENDERS = ("flatshard_compiled_float8", "fsdp2_compiled_float8")
RESULTS = {
    "step_time": "step_time_cuda-1b.json",
    "float8_compile": "float8_compile_cuda-1b.json",
    "step_time_gloo": "step_time_gloo_2ranks_1gpu.json",
}
# --rehearse-cpu: the benchmark parts on the CPU, the tiny GPT (its numbers mean nothing)
CPU_REHEARSAL = ["--preset", "tiny", "--device", "cpu"]
# step_time_gloo: two processes on GPU 0 over gloo (the stream protocol with real communication on one GPU),
# a smaller GPT than cuda-1b since gloo moves CUDA tensors through host memory.
GLOO_MODEL = ["--d-model", "1024", "--n-layer", "8", "--world-size", "2", "--backend", "gloo"]
RACE_MARK = "CSAN detected a possible data race"


# ----------------------------------------------------------------------------------------------------------
# Versions
# ----------------------------------------------------------------------------------------------------------


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())


def write_json(path: Path, report: Any, default: Any = None) -> None:
    path.write_text(json.dumps(report, indent=2, default=default) + "\n")


def tested_torch_floor() -> str | None:
    """The lowest torch ``pyproject.toml`` declares (the lowest version the project has tested)."""
    try:
        text = (REPO / "pyproject.toml").read_text()
    except OSError:
        return None
    match = re.search(r'"torch\s*>=\s*([0-9][0-9.]*)', text)
    return match.group(1) if match else None


def _release(version: str) -> tuple[int, ...]:
    """``"2.11.0+cu128"`` -> ``(2, 11, 0)``."""
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def below_floor(version: str, floor: str | None) -> bool:
    if floor is None:
        return False
    have, need = _release(version), _release(floor)
    width = max(len(have), len(need))
    return have + (0,) * (width - len(have)) < need + (0,) * (width - len(need))


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def environment() -> dict[str, Any]:
    """Versions and devices; on CUDA also cuDNN, NCCL, the driver and every GPU."""
    floor = tested_torch_floor()
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_tested_floor": floor,
        "torch_below_tested_floor": below_floor(torch.__version__, floor),
        "cuda_available": torch.cuda.is_available(),
        "cuda": torch.version.cuda,
        "lightning": _package_version("lightning"),
        "torchmetrics": _package_version("torchmetrics"),
        "pytest": _package_version("pytest"),
        "flatshard_source": str(REPO / "src"),
        "flatshard_version": _flatshard_version(),
        "git_commit": git_commit(),
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        info["cudnn"] = torch.backends.cudnn.version()
        try:
            nccl = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except (AttributeError, RuntimeError):
            info["nccl"] = None
        info["driver"] = _driver_version()
        info["gpus"] = [
            {
                "name": props.name,
                "memory_gib": round(props.total_memory / 2**30, 1),
                "capability": f"{props.major}.{props.minor}",
            }
            for props in (torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count()))
        ]
    return info


def _flatshard_version() -> str | None:
    match = re.search(r'__version__\s*=\s*"([^"]+)"', (REPO / "src" / "flatshard" / "version.py").read_text())
    return match.group(1) if match else None


# ----------------------------------------------------------------------------------------------------------
# Running a part
# ----------------------------------------------------------------------------------------------------------


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment with ``src/`` first on ``PYTHONPATH`` (flatshard from this tree, torch as installed)
    and no rank variables a launcher may have left."""
    env = dict(os.environ)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    paths = [str(REPO / "src"), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.pop("TORCH_CUDA_SANITIZER", None)  # only the sanitizer part sets it
    env.update(extra or {})
    return env


def run_logged(
    cmd: list[str], log: Path, timeout: float, env_extra: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``cmd`` from the repository root with its output in ``log``; kill its process group on timeout
    (the ranks it spawned included). Returns the return code (``None`` on timeout) and the duration."""
    t0 = time.perf_counter()
    with log.open("w") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=child_env(env_extra),
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    return {
        "command": shlex.join(cmd),
        "log": log.name,
        "returncode": rc,
        "timed_out": rc is None,
        "duration_s": round(time.perf_counter() - t0, 1),
    }


def log_tail(log: Path, chars: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


def _failed(run: dict[str, Any], reason: str, log: Path) -> dict[str, Any]:
    return {**run, "status": "failed", "reason": reason, "log_tail": log_tail(log)}


def part_parity(out: Path, timeout: float, sanitizer: bool = False) -> dict[str, Any]:
    """The worker on CUDA: 4 steps as is, or 2 under the CUDA sanitizer."""
    name = "sanitizer" if sanitizer else "parity"
    result = out / f"{name}.json"
    log = out / f"{name}.log"
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_check_worker.py"), "--device", "cuda"]
    rank_timeout = max(20, int(timeout) - 20)  # the ranks' own limit: the worker still writes its result
    cmd += ["--steps", "2" if sanitizer else "4", "--out", str(result), "--timeout", str(rank_timeout)]
    run = run_logged(cmd, log, timeout, {"TORCH_CUDA_SANITIZER": "1"} if sanitizer else None)
    report = _read_json(result)
    details = {
        k: report.get(k)
        for k in ("checks", "losses", "reference_losses", "limiter_waits", "grad_scale", "duration_s")
        if report and k in report
    }
    run["details"] = {"result": result.name, **details}
    text = log_tail(log, 10**6)
    if sanitizer:
        run["details"]["race_detected"] = RACE_MARK in text
        if RACE_MARK in text:
            start = text.index(RACE_MARK)
            run["details"]["first_race_report"] = text[start : start + 4000]
            return _failed(run, f"the CUDA sanitizer reported a stream-ordering race (see {log.name})", log)
    if run["timed_out"]:
        return _failed(run, f"timed out after {timeout:.0f} s", log)
    if report is None:
        return _failed(run, f"the worker wrote no result (exit status {run['returncode']})", log)
    if report.get("error"):
        return _failed(run, "the worker raised: " + report["error"].strip().splitlines()[-1], log)
    if not report.get("passed") or run["returncode"] != 0:
        bad = [k for k, c in (report.get("checks") or {}).items() if not c.get("ok")]
        return _failed(run, f"checks failed: {', '.join(bad) or '?'}", log)
    return {**run, "status": "passed", "reason": None}


def _junit_summary(path: Path) -> dict[str, Any]:
    """Totals, failed test ids and skip reasons from pytest's JUnit XML."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    totals = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed, skipped = [], {}
    for case in root.iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(test_id)
        skip = case.find("skipped")
        if skip is not None:
            skipped[test_id] = skip.get("message", "")
    totals["passed"] = totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"]
    return {**totals, "failed_tests": failed, "skipped_tests": skipped}


def part_pytest(out: Path, timeout: float) -> dict[str, Any]:
    log = out / "pytest_gpu.log"
    if importlib.util.find_spec("pytest") is None:
        return {
            "status": "failed",
            "reason": "pytest is not installed (pip install pytest pytest-timeout: they leave torch alone)",
        }
    xml = out / "pytest_gpu.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-rs", "-p", "no:cacheprovider"]
    cmd += ["--junitxml", str(xml)]
    run = run_logged(cmd, log, timeout)
    run["details"] = _junit_summary(xml)
    if run["timed_out"]:
        return _failed(run, f"timed out after {timeout:.0f} s", log)
    if run["returncode"] == 5:
        return _failed(run, "pytest collected no test", log)
    if run["returncode"] != 0:
        failed = run["details"].get("failed_tests") or []
        why = f"{len(failed)} test(s) failed: {', '.join(failed[:6])}" if failed else "pytest failed"
        if run["returncode"] in (2, 3, 4):
            why = f"pytest exited with {run['returncode']} (collection or usage error; see {log.name})"
        return _failed(run, why, log)
    return {**run, "status": "passed", "reason": None}


def bench_command(name: str, args: argparse.Namespace, result: Path, timeout: float) -> tuple[list[str], str]:
    """The ``python -m benchmarks train`` command of a benchmark part, and what its contenders are."""
    model = ["--preset", "cuda-1b", *(GLOO_MODEL if name == "step_time_gloo" else [])]
    contenders = args.bench_contenders
    if name == "float8_compile":
        float8 = importlib.util.find_spec("torchao") is not None
        contenders = ",".join(COMPILE_CONTENDERS + (FLOAT8_CONTENDERS if float8 else ()))
        model += ["--world-size", "1"]
    if args.rehearse_cpu:
        model = CPU_REHEARSAL + (["--world-size", "1"] if name == "float8_compile" else [])
    count = len(contenders.split(","))
    # a compiled contender compiles in its first step: each may take a third of the part's time
    per_contender = max(120, int(timeout / 3)) if name == "float8_compile" else max(60, int(timeout / count))
    cmd = [sys.executable, "-m", "benchmarks", "train", *model]
    cmd += ["--steps", str(args.bench_steps), "--warmup", str(args.bench_warmup)]
    cmd += ["--contenders", contenders, "--out", str(result), "--timeout", str(per_contender)]
    return cmd, contenders


def part_step_time(
    out: Path, timeout: float, args: argparse.Namespace, name: str = "step_time"
) -> dict[str, Any]:
    """``python -m benchmarks train --preset cuda-1b``: one rank per GPU over NCCL (``step_time``), two on GPU 0
    over gloo (``step_time_gloo``), or the eager / compiled / float8 rows on one rank (``float8_compile``)."""
    gpus = torch.cuda.device_count()
    log = out / f"{name}.log"
    result = out / (f"{name}_tiny_cpu-rehearsal.json" if args.rehearse_cpu else RESULTS[name])
    cmd, contenders = bench_command(name, args, result, timeout)
    run = run_logged(cmd, log, timeout)
    report = _read_json(result)
    if args.rehearse_cpu:
        scope = "CPU rehearsal, tiny GPT: the command runs and its result is read; the numbers mean nothing"
    elif name == "float8_compile":
        scope = (
            "1 rank on GPU 0: flatshard and FSDP2 eager, each Block compiled, and compiled with torchao float8 "
            "(tensorwise, float8 all-gather); MFU of the float8 rows against the bf16 peak"
        )
    elif name == "step_time_gloo":
        scope = "2 ranks on GPU 0 over gloo (d_model 1024, 8 layers): real communication through host memory"
    elif gpus > 1:
        scope = f"{gpus} ranks, one per GPU, NCCL"
    else:
        scope = (
            "1 GPU: every contender runs on a single rank, so this compares compute and memory overheads; "
            "nothing is communicated"
        )
    world = {"step_time": gpus, "float8_compile": 1, "step_time_gloo": 2}[name]
    details: dict[str, Any] = {"result": result.name, "world_size": world, "scope": scope}
    rows = {r["name"]: r for r in (report or {}).get("rows", [])}
    if report:
        details["contenders"] = {
            n: {
                "status": r["status"],
                **{
                    k: r["metrics"].get(k)
                    for k in ("step_s", "tokens_per_s", "mfu", "cuda_max_allocated_mib", "float8")
                },
                "cuda_phase_peaks_mib_per_rank": [
                    k.get("cuda_phase_peaks_mib") for k in (r["runs"] or [[]])[-1]
                ],
                "final_loss": r["metrics"].get("final_loss"),
                "check": r["check"],
                **({"error": str(r.get("error", ""))[-600:]} if r["status"] == "failed" else {}),
            }
            for n, r in rows.items()
        }
        details.update(ratios=report.get("ratios"), notes=report.get("notes"), table=report.get("table"))
    run["details"] = details
    if run["timed_out"] and timeout < CAPS[name]:  # cut short by the budget, not by its own cap
        reason = f"time budget: stopped after {timeout:.0f} s, less than its {CAPS[name]} s cap"
        return {**run, "status": "skipped", "reason": reason, "log_tail": log_tail(log)}
    if run["timed_out"]:
        return _failed(run, f"timed out after {timeout:.0f} s", log)
    if report is None:
        return _failed(run, f"the benchmark wrote no result (exit status {run['returncode']})", log)
    ours = [n for n in contenders.split(",") if n.startswith("flatshard")]
    bad = [n for n in ours if rows.get(n, {}).get("status") != "ok"]
    if bad:
        return _failed(run, f"{', '.join(bad)} failed or its losses differ from the reference's", log)
    wrong = [n for n, r in rows.items() if r["status"] == "check failed"]
    if wrong:
        return _failed(run, f"losses differ from the reference's: {', '.join(wrong)}", log)
    warnings = []
    peers_failed = [n for n, r in rows.items() if r["status"] == "failed"]
    if peers_failed:
        warnings.append(f"peer contender(s) failed: {', '.join(peers_failed)} (see {log.name})")
    if name == "float8_compile" and not any(n.endswith("_float8") for n in contenders.split(",")):
        warnings.append("torchao is not installed: the float8 rows did not run (pip install torchao)")
    if warnings:
        run["warnings"] = warnings
    return {**run, "status": "passed", "reason": None}


# ----------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("out_dir", type=Path, help="where the summary (gpu_check.json), logs and results go")
    p.add_argument("--budget-s", type=float, default=570.0, help="time for all parts together (default 570)")
    p.add_argument("--skip", default="", help=f"comma-separated parts to skip: {', '.join(PARTS)}")
    p.add_argument("--bench-steps", type=int, default=5, help="the benchmark's --steps (default 5)")
    p.add_argument("--bench-warmup", type=int, default=2, help="the benchmark's --warmup (default 2)")
    p.add_argument("--bench-contenders", default="flatshard,fsdp1,fsdp2,ddp", help="step_time's --contenders")
    p.add_argument(
        "--rehearse-cpu",
        action="store_true",
        help="without CUDA: run the benchmark parts on the CPU with the tiny GPT (their commands, not numbers)",
    )
    return p.parse_args(argv)


def print_summary(summary: dict[str, Any]) -> None:
    print()
    for name, part in summary["parts"].items():
        line = f"  {name:<14} {part['status']:<8} {part.get('duration_s', 0.0):>6.1f} s"
        if part.get("reason"):
            line += f"  {part['reason']}"
        print(line)
        for warning in part.get("warnings", []):
            print(f"  {'':<14} warning: {warning}")
    print(f"\n{summary['status']}: {summary['out']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = skip - set(PARTS)
    if unknown:
        raise SystemExit(f"--skip: unknown part(s) {sorted(unknown)}; the parts are {', '.join(PARTS)}")
    start = time.perf_counter()
    env = environment()
    summary: dict[str, Any] = {
        "check": "gpu_check",
        "date": utc_now(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "out": str(out / "gpu_check.json"),
        "status": "running",
        "environment": env,
        "budget_s": args.budget_s,
        "parts": {},
    }
    if env["torch_below_tested_floor"]:
        warning = (
            f"torch {torch.__version__} is below the tested floor torch>={env['torch_tested_floor']} "
            "(pyproject.toml); running anyway: nothing is reinstalled, and this run is what tests it"
        )
        print(f"warning: {warning}", flush=True)
        summary["warnings"] = [warning]
    if args.rehearse_cpu and not torch.cuda.is_available():
        return rehearse(args, out, skip, summary, start)
    if not torch.cuda.is_available():
        print("no CUDA device (torch.cuda.is_available() is False): nothing to check here; skipped")
        summary["status"] = "skipped: no CUDA"
        summary["parts"] = {name: {"status": "skipped", "reason": "no CUDA"} for name in PARTS}
        summary["duration_s"] = round(time.perf_counter() - start, 1)
        write_json(out / "gpu_check.json", summary, default=str)
        print_summary(summary)
        return 0
    print(
        f"torch {torch.__version__}, CUDA {env['cuda']}, GPUs: {[g['name'] for g in env['gpus']]}", flush=True
    )
    for name in PARTS:
        left = args.budget_s - (time.perf_counter() - start)
        if name in skip:
            result: dict[str, Any] = {"status": "skipped", "reason": "--skip"}
        elif left < MIN_START[name]:
            result = {
                "status": "skipped",
                "reason": f"time budget: {left:.0f} s left of {args.budget_s:.0f} s",
            }
        else:
            print(f"[{name}] ...", flush=True)
            timeout = min(CAPS[name], left)
            if name == "parity":
                result = part_parity(out, timeout)
            elif name == "sanitizer":
                result = part_parity(out, timeout, sanitizer=True)
            elif name == "pytest_gpu":
                result = part_pytest(out, timeout)
            else:
                result = part_step_time(out, timeout, args, name)
            print(f"[{name}] {result['status']} {result.get('reason') or ''}".rstrip(), flush=True)
        summary["parts"][name] = result
        write_json(out / "gpu_check.json", summary, default=str)  # partial results survive a kill
    statuses = [p["status"] for p in summary["parts"].values()]
    if "failed" in statuses:
        summary["status"] = "failed"
    elif all(p["status"] == "passed" or p.get("reason") == "--skip" for p in summary["parts"].values()):
        summary["status"] = "passed"
    else:
        summary["status"] = "incomplete"  # a part was skipped for lack of time
    summary["duration_s"] = round(time.perf_counter() - start, 1)
    write_json(out / "gpu_check.json", summary, default=str)
    print_summary(summary)
    return 1 if summary["status"] == "failed" else 0


def rehearse(
    args: argparse.Namespace, out: Path, skip: set[str], summary: dict[str, Any], start: float
) -> int:
    """``--rehearse-cpu``: the benchmark parts on the CPU with the tiny GPT (no time budget: caps only), the
    others skipped; the status says it was a rehearsal."""
    print("no CUDA device: rehearsing the benchmark parts on the CPU (tiny GPT)", flush=True)
    for name in PARTS:
        if name not in BENCH_PARTS or name == "step_time_gloo" or name in skip:
            result: dict[str, Any] = {
                "status": "skipped",
                "reason": "CPU rehearsal" if name not in skip else "--skip",
            }
        else:
            print(f"[{name}] ...", flush=True)
            result = part_step_time(out, max(CAPS[name], 600), args, name)
            print(f"[{name}] {result['status']} {result.get('reason') or ''}".rstrip(), flush=True)
        summary["parts"][name] = result
        write_json(out / "gpu_check.json", summary, default=str)
    failed = any(p["status"] == "failed" for p in summary["parts"].values())
    summary["status"] = f"CPU rehearsal {'failed' if failed else 'passed'}"
    summary["duration_s"] = round(time.perf_counter() - start, 1)
    write_json(out / "gpu_check.json", summary, default=str)
    print_summary(summary)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
