"""Checking a contender's output before comparing against it: fault logs of crashed ranks, saved states
compared tensor by tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from bench_model import build_model

# ----------------------------------------------------------------------------------------------------------
# Faults and correctness
# ----------------------------------------------------------------------------------------------------------


def fault_log_path(cfg: dict[str, Any], name: str, rank: int) -> Path:
    """Where a rank of contender ``name`` has ``faulthandler`` write (under ``cfg["tmpdir"]``)."""
    return Path(cfg["tmpdir"]) / f"fault_{name}_{cfg.get('fsdp1_offload', '')}_rank{rank}.log"


def crash_report(cfg: dict[str, Any], name: str, world_size: int) -> str:
    """What faulthandler wrote for a rank that died hard: the fatal error and the innermost frame."""
    lines = []
    for rank in range(world_size):
        path = fault_log_path(cfg, name, rank)
        text = path.read_text().strip().splitlines() if path.exists() else []
        fatal = [ln for ln in text if ln.startswith("Fatal Python error")]
        if fatal:
            frames = [ln.strip() for ln in text if ln.strip().startswith("File ")]
            lines.append(f"rank {rank}: {fatal[0]}" + (f" at {frames[0]}" if frames else ""))
    return "; ".join(lines)


def reference_param_names(cfg: dict[str, Any]) -> list[str]:
    """``named_parameters()`` of the unsharded GPT, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = build_model(cfg)
    return [n for n, _ in model.named_parameters()]


def model_state_equal(a: dict[str, Any], b: dict[str, Any]) -> tuple[bool, list[str]]:
    """Same keys and torch.equal tensors; returns (equal, the keys that differ)."""
    if set(a) != set(b):
        return False, sorted(set(a) ^ set(b))[:10]
    bad = []
    for k, v in a.items():
        w = b[k]
        if isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor):
            if v.shape != w.shape or v.dtype != w.dtype or not torch.equal(v, w):
                bad.append(k)
        elif v != w:
            bad.append(k)
    return not bad, bad


def optim_entry_equal(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    if a is None or b is None or set(a) != set(b):
        return False
    return all(
        torch.equal(torch.as_tensor(a[k]).float(), torch.as_tensor(b[k]).float())
        if isinstance(a[k], torch.Tensor) or isinstance(b[k], torch.Tensor)
        else a[k] == b[k]
        for k in a
    )


def optim_by_name(name: str, osd: dict[str, Any], param_names: list[str]) -> dict[str, dict[str, Any]]:
    """Optimizer state keyed by parameter name. flatshard numbers parameters in ``param_groups`` order
    (= ``model.named_parameters()`` order, the optimizer was built from ``model.parameters()``); FSDP1 and
    FSDP2 already key it by FQN."""
    state = osd["state"]
    if name == "flatshard":
        ids = [i for g in osd["param_groups"] for i in g["params"]]
        return {param_names[pos]: state[i] for pos, i in enumerate(ids) if i in state}
    return {str(k): v for k, v in state.items()}


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float | None:
    if a.shape != b.shape:
        return None
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def check_correctness(
    contenders: list[str], tmpdir: Path, param_names: list[str], reference_names: list[str]
) -> dict[str, Any]:
    """Compare every contender's saved state with the first one's (flatshard when it ran)."""
    files = {c: tmpdir / f"{c}.pt" for c in contenders if (tmpdir / f"{c}.pt").exists()}
    out: dict[str, Any] = {
        "reference": None,
        "compared": list(files),
        "param_order_matches_unsharded_model": param_names == reference_names,
    }
    if len(files) < 2:
        out["note"] = "fewer than two contenders saved a state: nothing to compare"
        out["all_equal"] = None
        return out
    loaded = {c: torch.load(p, map_location="cpu", mmap=True) for c, p in files.items()}
    ref = next(iter(loaded))
    out["reference"] = ref
    ref_opt = optim_by_name(ref, loaded[ref]["optim"], param_names)
    out["optimizer_state_names_match_parameters"] = set(ref_opt) == set(param_names)
    all_equal = True
    pairs: dict[str, Any] = {}
    for c in loaded:
        if c == ref:
            continue
        model_eq, bad_keys = model_state_equal(loaded[ref]["model"], loaded[c]["model"])
        opt_c = optim_by_name(c, loaded[c]["optim"], param_names)
        entry: dict[str, Any] = {
            "model_same_keys": set(loaded[ref]["model"]) == set(loaded[c]["model"]),
            "model_tensors_equal": model_eq,
            "model_keys_differing": bad_keys,
            "optim_same_param_names": set(ref_opt) == set(opt_c),
        }
        max_diff: dict[str, float | None] = {}
        for key in ("exp_avg", "exp_avg_sq"):
            differing = []
            worst = 0.0
            for pname, st in ref_opt.items():
                a, b = st.get(key), opt_c.get(pname, {}).get(key)
                if a is None or b is None or a.shape != b.shape:
                    differing.append(pname)
                    worst = float("nan")
                elif not torch.equal(a, b):
                    differing.append(pname)
                    worst = max(worst, max_abs_diff(a, b) or 0.0)
            entry[f"{key}_equal"] = not differing and entry["optim_same_param_names"]
            entry[f"{key}_params_differing"] = differing[:10]
            max_diff[key] = worst
        steps = {float(torch.as_tensor(st["step"]).item()) for st in [*ref_opt.values(), *opt_c.values()]}
        entry["step_values"] = sorted(steps)
        if not model_eq:
            max_diff["model"] = max(
                (max_abs_diff(loaded[ref]["model"][k], loaded[c]["model"][k]) or 0.0)
                for k in bad_keys
                if k in loaded[c]["model"] and k in loaded[ref]["model"]
            )
        entry["max_abs_diff"] = max_diff
        entry["equal"] = entry["model_same_keys"] and model_eq and entry["exp_avg_equal"]
        all_equal = all_equal and entry["equal"]
        pairs[f"{ref}_vs_{c}"] = entry
    out["pairs"] = pairs
    out["all_equal"] = all_equal  # model keys + tensors and AdamW exp_avg, bitwise
    del loaded
    return out
