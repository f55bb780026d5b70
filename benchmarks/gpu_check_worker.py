"""Two ranks on one device over gloo through flatshard's whole CUDA path, against an unsharded reference.

Part of ``gpu_check.py``, which runs it on ``--device cuda`` twice: as is, and briefly under
``TORCH_CUDA_SANITIZER=1``. It runs on ``--device cpu`` as well (the same code, CPU tensors), which is how the
CPU test suite keeps this script working (``tests/distributed/test_gpu_check_worker.py``).

**What runs** (one configuration, everything on at once): TinyGPT (``flatshard.testing.models``: odd sizes,
tied embedding and head), ``FULL_SHARD`` with one unit per ``Block``, ``forward_prefetch=True``,
``backward_prefetch=BACKWARD_PRE``, ``limit_all_gathers=True``, ``cpu_offload=True`` (pinned CPU shards, the
optimizer steps on CPU) and ``MixedPrecision(param_dtype=float16, reduce_dtype=float32)``; each step runs under
``torch.autocast(float16)`` and scales the loss with ``FlatShardGradScaler``: what
``Trainer(precision="16-mixed", strategy=FlatShardStrategy(cpu_offload=True, forward_prefetch=True))`` does.

**Why gloo on one GPU**: NCCL refuses two ranks on one device; gloo moves CUDA tensors (through pinned host
buffers), so the engine's side streams, events, pinned offload copies and the all-gather limiter run as they
do on a multi-GPU machine, on a machine with a single GPU.

**The reference** (this process, nothing sharded): fp32 master weights on the CPU, where the offloaded
optimizer steps too. For each rank's slice of the global batch a float16 copy of the model on the device runs
the same autocast forward and scaled backward; the fp32 sum of the slices' gradients over the world size is
what the sharded run reduces to, and torch's own ``GradScaler`` unscales, checks for inf/NaN, steps SGD and
updates the scale. So the two runs do the same arithmetic, and losses and weights must agree closely.

    python benchmarks/gpu_check_worker.py --device cuda --out /tmp/parity.json
    python benchmarks/gpu_check_worker.py --device cpu --steps 2   # the CPU path (what the test runs)

Exit status: 0 when every check passed, 1 otherwise (the JSON, written either way, says which).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

WORLD = 2  # ranks, all on one device
PER_RANK = 2  # samples per rank and step
N_LAYER = 4  # TinyGPT blocks: 4 units plus the root, so prefetch and the limiter have something to do
LR = 0.1  # plain SGD: linear in the gradients, so the comparison is tight
INIT_SCALE = 2.0**10
GROWTH_INTERVAL = 2  # the scale grows during a short run, on both sides
# Both runs do the same float16 arithmetic per slice. What can still differ is a kernel's choice (GPU libraries
# pick kernels by shape and pointer alignment, and the sharded run's parameters are views at odd offsets of one
# flat buffer) and with it the summation order: one float16 ulp in a gradient or a logit, about 2.4e-4 near 0.5
# and 4e-3 near 4, measured at 2e-4 on the weights after 4 steps when the CPU thread counts differ. What the
# check hunts moves weights much more: a missed or doubled gradient contribution or stale parameters shift
# them by about lr * |grad| (1e-2 and more here); a gradient 10% off gives 3e-2.
TOLERANCE = {"weights": 2e-3, "losses": 5e-3}  # losses: relative to max(1, |loss|)


def _device(cfg: dict[str, Any]) -> torch.device:
    if cfg["device"] == "cuda":
        torch.cuda.set_device(cfg["gpu"])
        return torch.device("cuda", cfg["gpu"])
    return torch.device("cpu")


def _model(cfg: dict[str, Any]) -> torch.nn.Module:
    from flatshard.testing.models import TinyGPT

    torch.manual_seed(cfg["seed"])
    return TinyGPT(n_layer=N_LAYER)


def _slice(rank: int) -> slice:
    return slice(rank * PER_RANK, (rank + 1) * PER_RANK)


def _autocast(device: torch.device) -> Any:
    return torch.autocast(device_type=device.type, dtype=torch.float16)


def run_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank of the sharded run (inside ``flatshard.testing.spawn``); returns what the parent compares."""
    import flatshard
    from flatshard.engine import unit_states
    from flatshard.engine.transport import comm
    from flatshard.lightning.precision import FlatShardGradScaler
    from flatshard.testing.models import Block, make_batch

    device = _device(cfg)
    model = _model(cfg).to(device)
    flatshard.shard(
        model,
        sharding_strategy="FULL_SHARD",
        auto_wrap_policy={Block},
        forward_prefetch=True,
        backward_prefetch="BACKWARD_PRE",
        limit_all_gathers=True,
        cpu_offload=True,
        mixed_precision=flatshard.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32),
        device=device,
    )
    handles = [h for s in unit_states(model) for h in s.handles]
    info: dict[str, Any] = {
        "rank": rank,
        "shard_devices": sorted({h.sharded.device.type for h in handles}),
        "shards_pinned": all(h.sharded.is_pinned() for h in handles),
        "param_devices": sorted({p.device.type for p in model.parameters()}),
        "sanitizer_active": _sanitizer_active(),
    }
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = FlatShardGradScaler(device.type, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    comm.comm_stats.clear()
    losses: list[float] = []
    step_s: list[float] = []
    for step in range(cfg["steps"]):
        idx, tgt = (t.to(device) for t in make_batch(step, PER_RANK * world))
        t0 = time.perf_counter()
        with _autocast(device):
            loss = model.loss(idx[_slice(rank)], tgt[_slice(rank)])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().float().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_s.append(time.perf_counter() - t0)
    root = unit_states(model)[0]
    assert root.ctx is not None, "the root's lazy init did not run"
    full, _ = flatshard.get_state_dict(model, rank0_only=False)
    info.update(
        losses=losses,
        step_s=step_s,
        grad_scale=float(scaler.get_scale()),
        limiter_waits=root.ctx.limiter.waits,
        all_gather_bytes=int(comm.comm_stats["all_gather"]),
        reduce_scatter_bytes=int(comm.comm_stats["reduce_scatter"]),
        state={k: v.detach().cpu() for k, v in full.items()},
        cuda_max_allocated_mib=(
            torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
        ),
    )
    return info


def reference_run(cfg: dict[str, Any]) -> dict[str, Any]:
    """The unsharded single-process run described in the module docstring."""
    from flatshard.testing.models import make_batch

    device = _device(cfg)
    world = cfg["world"]
    # One intra-op thread, as each rank has (flatshard.testing.spawn): CPU kernels then split their sums alike.
    torch.set_num_threads(1)
    master = _model(cfg)  # fp32, on the CPU like the offloaded shards
    initial = {k: v.clone() for k, v in master.state_dict().items()}
    opt = torch.optim.SGD(master.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    scaler.scale(torch.zeros(()))  # creates the scale tensor, as the first scale(loss) would
    losses: list[float] = []
    for step in range(cfg["steps"]):
        idx, tgt = (t.to(device) for t in make_batch(step, PER_RANK * world))
        scale = scaler.get_scale()
        grads: list[torch.Tensor] | None = None
        step_losses = []
        for r in range(world):
            low = copy.deepcopy(master).to(device=device, dtype=torch.float16)
            with _autocast(device):
                loss = low.loss(idx[_slice(r)], tgt[_slice(r)])
            (loss * scale).backward()
            step_losses.append(loss.detach().float().item())
            mine = [p.grad.float().cpu() for p in low.parameters()]
            grads = mine if grads is None else [a + b for a, b in zip(grads, mine)]
        assert grads is not None
        for p, g in zip(master.parameters(), grads):
            p.grad = g / world
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(sum(step_losses) / world)
    return {
        "losses": losses,
        "grad_scale": float(scaler.get_scale()),
        "state": {k: v.detach().clone() for k, v in master.state_dict().items()},
        "initial": initial,
    }


def _sanitizer_active() -> bool:
    sanitizer = sys.modules.get("torch.cuda._sanitizer")
    return bool(sanitizer is not None and getattr(sanitizer.cuda_sanitizer, "enabled", False))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(
        ((a[k].float() - v.float()).abs().max().item() for k, v in b.items() if v.is_floating_point()),
        default=0.0,
    )


def compare(cfg: dict[str, Any], reference: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Each check's value, its bound and whether it holds; ``passed`` when all do."""
    cuda = cfg["device"] == "cuda"
    checks: dict[str, dict[str, Any]] = {}

    def check(name: str, ok: bool, value: Any = None, bound: Any = None, note: str | None = None) -> None:
        checks[name] = {"ok": bool(ok), "value": value, "bound": bound, **({"note": note} if note else {})}

    missing = sorted(set(reference["state"]) - set(ranks[0]["state"]))
    check("state_keys", not missing, value=missing or "all present")
    weights = max(_max_diff(r["state"], reference["state"]) for r in ranks)
    check("weights_vs_reference", weights <= TOLERANCE["weights"], weights, TOLERANCE["weights"])
    losses = max(
        abs(a - b) / max(1.0, abs(b)) for r in ranks for a, b in zip(r["losses"], reference["losses"])
    )
    check("losses_vs_reference", losses <= TOLERANCE["losses"], losses, TOLERANCE["losses"])
    ranks_agree = _max_diff(ranks[1]["state"], ranks[0]["state"])
    check("ranks_agree", ranks_agree == 0.0, ranks_agree, 0.0)
    scales = [r["grad_scale"] for r in ranks]
    check("grad_scale", all(s == reference["grad_scale"] for s in scales), scales, reference["grad_scale"])
    changed = _max_diff(reference["state"], reference["initial"])
    check("weights_moved", changed > 50 * TOLERANCE["weights"], changed, f"> {50 * TOLERANCE['weights']}")
    check("shards_offloaded", all(r["shard_devices"] == ["cpu"] for r in ranks), ranks[0]["shard_devices"])
    check("shards_pinned", all(r["shards_pinned"] for r in ranks) == cuda, ranks[0]["shards_pinned"], cuda)
    waits = [r["limiter_waits"] for r in ranks]
    if cuda:
        check("limiter_engaged", all(w > 0 for w in waits), waits, "> 0 on every rank")
    else:  # see [Note: rate limiter]: CPU work is synchronous, no free event is ever pending
        check("limiter_engaged", all(w == 0 for w in waits), waits, "0 on CPU", note="a CUDA-only mechanism")
    if cfg["sanitizer"]:
        active = [r["sanitizer_active"] for r in ranks]
        check("sanitizer_active", all(active), active, True)
    return {
        "passed": all(c["ok"] for c in checks.values()),
        "checks": checks,
        "losses": ranks[0]["losses"],
        "reference_losses": reference["losses"],
        "grad_scale": scales[0],
        "limiter_waits": waits,
        "all_gather_bytes_per_rank": [r["all_gather_bytes"] for r in ranks],
        "reduce_scatter_bytes_per_rank": [r["reduce_scatter_bytes"] for r in ranks],
        "step_s_rank0": ranks[0]["step_s"],
        "cuda_max_allocated_mib": [r["cuda_max_allocated_mib"] for r in ranks],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--gpu", type=int, default=0, help="the CUDA device both ranks use (default 0)")
    p.add_argument("--steps", type=int, default=4, help="training steps (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds the ranks may take")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = {
        "device": args.device,
        "gpu": args.gpu,
        "steps": args.steps,
        "seed": args.seed,
        "world": WORLD,
        "backend": "gloo",
        "sanitizer": "TORCH_CUDA_SANITIZER" in os.environ,
        "options": {
            "sharding_strategy": "FULL_SHARD",
            "auto_wrap_policy": "{Block}",
            "forward_prefetch": True,
            "backward_prefetch": "BACKWARD_PRE",
            "limit_all_gathers": True,
            "cpu_offload": True,
            "mixed_precision": "param_dtype=float16, reduce_dtype=float32, autocast float16, FlatShardGradScaler",
            "optimizer": f"SGD(lr={LR})",
        },
    }
    report: dict[str, Any] = {"config": cfg, "torch": torch.__version__, "passed": False, "error": None}
    t0 = time.perf_counter()
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda, but torch.cuda.is_available() is False")
        from flatshard.testing import spawn

        reference = reference_run(cfg)
        # spawn, not forkserver: each rank starts a fresh interpreter, which is where TORCH_CUDA_SANITIZER is read.
        ranks = spawn(run_rank, WORLD, cfg, backend="gloo", timeout=args.timeout, start_method="spawn")
        report.update(compare(cfg, reference, ranks))
    except Exception as err:
        report["error"] = traceback.format_exc()
        report["race_detected"] = "CUDASanitizerErrors" in str(err) or "CSAN detected" in str(err)
    report["duration_s"] = round(time.perf_counter() - t0, 2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    for name, c in report.get("checks", {}).items():
        print(f"{'ok  ' if c['ok'] else 'FAIL'} {name}: {c['value']} (bound {c['bound']})")
    if report["error"]:
        print(report["error"], file=sys.stderr)
    print(f"{'passed' if report['passed'] else 'FAILED'} in {report['duration_s']} s ({args.device})")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
