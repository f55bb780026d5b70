"""The CUDA stream protocol of ``cpu_offload="optimizer"``, checked on gloo ranks with the recording fake of
``tests/fake_streams.py`` (see [Note: host copies and the streams]).

Whole training steps (accumulation, clipping, an EMA-like in-place edit of the weights between steps, the
offloaded step): no stream or the host reads a buffer another stream wrote before waiting for it, no copy between
host and device memory blocks the CPU, gradient shards go to the host on ``post_backward`` and updated shards come
back on ``pre_unshard``, the CPU waits for the copies once per step and never in backward, and the result is the
ordinary CPU run's, bit for bit. Taking one of the waits out of the engine makes the checker fail.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import flatshard
from flatshard.engine.step.host_shard import HostShard
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch
from tests.fake_streams import HOST, record_streams

PER_RANK = 2
CONFIGS: dict[str, dict[str, Any]] = {
    "full_shard": {"limit_all_gathers": False},
    "bf16": {"mixed_precision": {"param_dtype": torch.bfloat16}},
    "keep_low_precision_grads": {
        "mixed_precision": {"param_dtype": torch.bfloat16, "keep_low_precision_grads": True}
    },
    "no_shard": {"sharding_strategy": "NO_SHARD"},
}


def _steps(rank: int, world: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Three optimizer steps, the second over two micro-batches, the third after an edit of the weights."""
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for step, micro in ((0, 1), (1, 2), (2, 1)):
        if step == 2:
            with torch.no_grad():  # written on the device between steps: the host copy must follow
                next(model.parameters()).mul_(0.5)
        for m in range(micro):
            idx, tgt = make_batch(10 * step + m, PER_RANK * world)
            model.loss(idx[mine], tgt[mine]).backward()
        flatshard.clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad()


def _trained(rank: int, world: int, options: dict[str, Any], fake: bool) -> tuple[dict[str, Any], Any]:
    torch.manual_seed(0)
    model = flatshard.shard(TinyGPT(), auto_wrap_policy={Block}, cpu_offload="optimizer", **options)
    if options.get("mixed_precision", {}).get("keep_low_precision_grads"):  # AdamW refuses bf16 gradients
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    if not fake:
        _steps(rank, world, model, opt)
        return flatshard.get_state_dict(model, rank0_only=False)[0], None
    with record_streams(model) as recorder:
        _steps(rank, world, model, opt)
    return flatshard.get_state_dict(model, rank0_only=False)[0], recorder


def _check(rank: int, world: int, options: dict[str, Any]) -> dict[str, Any]:
    full, rec = _trained(rank, world, options, fake=True)
    expected, _ = _trained(rank, world, options, fake=False)
    return {
        "violations": rec.violations,
        "blocking": rec.blocking,
        "h2d": sorted(rec.kinds_on("h2d")),
        "d2h": sorted(rec.kinds_on("d2h")),
        "host_syncs": sorted({e.where.split(" ")[0] for e in rec.log if e.kind == "synchronize"}),
        "host_ops": sum(n for (stream, _), n in rec.ops.items() if stream == HOST),
        "diff": max((full[k].float() - v.float()).abs().max().item() for k, v in expected.items()),
    }


def _run(rank: int, world: int, configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {name: _check(rank, world, options) for name, options in configs.items()}


@pytest.mark.timeout(600)
def test_optimizer_offload_stream_protocol() -> None:
    for result in spawn(_run, 2, CONFIGS):
        for name, r in result.items():
            assert r["violations"] == [], (name, r["violations"])
            assert r["blocking"] == [], (name, r["blocking"])
            assert r["h2d"] == ["pre_unshard"] and r["d2h"] == ["post_backward"], (name, r)
            # the CPU waits for the copies only before the step (HostShard.wait); the limiter's waits are its own
            mine = [w for w in r["host_syncs"] if not w.startswith("engine/transport/limiter.py")]
            assert mine and all(w.startswith("engine/step/host_shard.py") for w in mine), (
                name,
                r["host_syncs"],
            )
            assert r["host_ops"] > 0, (name, r)  # the step ran on host memory
            assert r["diff"] == 0.0, (name, r["diff"])


# ---------------------------------------------------------------------- the checker fails when a wait is removed
def _no_wait(self: HostShard) -> None:
    for name in ("_grad_event", "_params_event", "_back_event"):
        setattr(self, name, None)


_REAL_COPY = HostShard._copy


def _copy_without_wait(self: HostShard, dst: Any, src: Any, side: str) -> Any:
    event = _REAL_COPY(self, dst, src, side)
    return None if side == "pre_unshard" else event  # the compute stream no longer waits for the copy back


SABOTAGE = ("host_wait", "grad_write_wait", "copy_back_wait")


def _sabotaged(rank: int, world: int) -> dict[str, list[str]]:
    torch.set_num_threads(1)
    out = {}
    for name in SABOTAGE:
        with pytest.MonkeyPatch.context() as mp:
            if name == "host_wait":
                mp.setattr(HostShard, "wait", _no_wait)
            elif name == "grad_write_wait":
                mp.setattr(HostShard, "before_grad_write", lambda self, streams: None)
            else:
                mp.setattr(HostShard, "_copy", _copy_without_wait)
            _, rec = _trained(rank, world, {}, fake=True)
        out[name] = rec.violations
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checker_reports_a_removed_offload_wait() -> None:
    for r in spawn(_sabotaged, 2):
        assert any(v.startswith(f"{HOST} reads") and "post_backward" in v for v in r["host_wait"]), r
        assert any("overwrites" in v and "host_shard.py" in v for v in r["grad_write_wait"]), r
        assert any(v.startswith("unshard reads") and "on pre_unshard" in v for v in r["copy_back_wait"]), r
