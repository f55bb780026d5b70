"""The CUDA stream protocol, checked on gloo ranks with the recording fake of ``tests/fake_streams.py``.

For whole training steps (forward, backward, gradient accumulation, optimizer step) in each configuration:
no stream or the host reads a buffer another stream wrote before waiting for it, nothing is freed before
its users were waited for, no copy between host and device memory blocks the CPU, collectives and copies
run on the streams [Note: stream overlap] names, and training equals the unsharded model (or, under mixed
precision, the same configuration run on the ordinary CPU path). Taking a wait out of the engine makes the
checker fail.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import flatshard
from flatshard.engine import gradients as gradients_module
from flatshard.engine import unit_states
from flatshard.engine.handle import FlatParamHandle
from flatshard.engine.transport.streams import CommContext
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch
from tests.fake_streams import HOST, record_streams

PER_RANK = 2
BF16 = {"param_dtype": torch.bfloat16}

CONFIGS = {
    "full_shard": {"backward_prefetch": None, "limit_all_gathers": False},
    "shard_grad_op": {"sharding_strategy": "SHARD_GRAD_OP", "limit_all_gathers": False},
    "offload": {"cpu_offload": True, "limit_all_gathers": False},
    "offload_bf16": {"cpu_offload": True, "mixed_precision": BF16},
    "no_shard_offload": {"sharding_strategy": "NO_SHARD", "cpu_offload": True},
    "forward_prefetch_backward_pre": {
        "forward_prefetch": True,
        "backward_prefetch": "BACKWARD_PRE",
        "limit_all_gathers": False,
    },
    "backward_post": {"backward_prefetch": "BACKWARD_POST", "limit_all_gathers": False},
    "limit_all_gathers": {"limit_all_gathers": True, "forward_prefetch": True},
}
HYBRID = {"sharding_strategy": "HYBRID_SHARD", "shard_group_size": 2}
HYBRID_CONFIGS = {
    "hybrid": HYBRID,
    "hybrid_offload_bf16": {**HYBRID, "cpu_offload": True, "mixed_precision": BF16},
    # micro-batches reduce inside the shard group only (see [Note: replica reductions once per step])
    "hybrid_deferred": {**HYBRID, "defer": True},
    "hybrid_deferred_offload_bf16": {**HYBRID, "cpu_offload": True, "mixed_precision": BF16, "defer": True},
    # backward gathers from a copy kept over 2 of the 4 ranks (see [Note: a node-local copy for backward])
    "node_local_copy": {"reshard_after_forward": 2, "forward_prefetch": True},
}


def _steps(
    rank: int,
    world: int,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sharded: bool,
    defer: bool = False,
) -> None:
    """Two optimizer steps, the second over two accumulated micro-batches (``defer``: the first inside
    ``no_sync``)."""
    for step, micro in ((0, 1), (1, 2)):
        for m in range(micro):
            idx, tgt = make_batch(10 * step + m, PER_RANK * world)
            if sharded:
                idx, tgt = (
                    idx[rank * PER_RANK : (rank + 1) * PER_RANK],
                    tgt[rank * PER_RANK : (rank + 1) * PER_RANK],
                )
            if defer and m < micro - 1:
                with flatshard.no_sync(model):
                    model.loss(idx, tgt).backward()
            else:
                model.loss(idx, tgt).backward()
        opt.step()
        opt.zero_grad()


def _trained(rank: int, world: int, options: dict[str, Any], fake: bool) -> tuple[dict[str, Any], Any]:
    torch.manual_seed(0)
    options = dict(options)
    defer = options.pop("defer", False)
    model = flatshard.shard(TinyGPT(), auto_wrap_policy={Block}, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    recorder = None
    if fake:
        with record_streams(model) as recorder:
            _steps(rank, world, model, opt, sharded=True, defer=defer)
    else:
        _steps(rank, world, model, opt, sharded=True, defer=defer)
    full, _ = flatshard.get_state_dict(model, rank0_only=False)
    root = unit_states(model)[0]
    assert root.ctx is not None
    return full, (recorder, root.ctx.limiter.waits)


def _check(rank: int, world: int, options: dict[str, Any]) -> dict[str, Any]:
    full, (rec, waits) = _trained(rank, world, options, fake=True)
    mixed = "mixed_precision" in options
    if mixed:  # the CUDA paths give what the CPU paths give
        expected, _ = _trained(rank, world, options, fake=False)
    else:
        torch.manual_seed(0)
        reference = TinyGPT()
        _steps(rank, world, reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), False)
        expected = reference.state_dict()
    host_syncs = [e for e in rec.log if e.kind == "synchronize" and "post_backward" in e.detail]
    return {
        "violations": rec.violations,
        "blocking": rec.blocking,
        "streams": {
            k: sorted(rec.kinds_on(k)) for k in ("all_gather", "reduce_scatter", "all_reduce", "h2d", "d2h")
        },
        "host_syncs": len(host_syncs),
        "limiter_waits": waits,
        "diff": max((full[k].float() - v.float()).abs().max().item() for k, v in expected.items()),
        "mixed": mixed,
    }


def _run_configs(rank: int, world: int, configs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: _check(rank, world, options) for name, options in configs.items()}


def _assert_protocol(name: str, options: dict[str, Any], r: dict[str, Any]) -> None:
    assert r["violations"] == [], (name, r["violations"])
    assert r["blocking"] == [], (name, r["blocking"])
    streams = r["streams"]
    strategy = options.get("sharding_strategy")
    sharded = [] if strategy == "NO_SHARD" else ["unshard"]  # NO_SHARD: nothing to gather or scatter
    assert streams["all_gather"] == sharded, (name, streams)
    assert streams["reduce_scatter"] == (["post_backward"] if sharded else []), (name, streams)
    replicated = strategy in ("HYBRID_SHARD", "NO_SHARD")
    assert streams["all_reduce"] == (["post_backward"] if replicated else []), (name, streams)
    if options.get("cpu_offload"):
        assert streams["h2d"] == ["pre_unshard"] and streams["d2h"] == ["post_backward"], (name, streams)
        # once per backward that reduces across replicas (a deferred micro-batch copies nothing to the host)
        assert r["host_syncs"] == (2 if options.get("defer") else 3), (name, r["host_syncs"])
    else:
        assert streams["h2d"] == [] and streams["d2h"] == [] and r["host_syncs"] == 0, (name, r)
    if options.get("limit_all_gathers", True) and sharded:
        assert r["limiter_waits"] > 0, (name, r)
    if r["mixed"]:
        assert r["diff"] == 0.0, (name, r["diff"])
    else:
        assert r["diff"] <= 1e-5, (name, r["diff"])


@pytest.mark.timeout(600)
def test_stream_protocol_two_ranks() -> None:
    for rank_result in spawn(_run_configs, 2, CONFIGS):
        for name, options in CONFIGS.items():
            _assert_protocol(name, options, rank_result[name])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_stream_protocol_hybrid() -> None:
    for rank_result in spawn(_run_configs, 4, HYBRID_CONFIGS):
        for name, options in HYBRID_CONFIGS.items():
            _assert_protocol(name, options, rank_result[name])


# ---------------------------------------------------------------------- the checker fails when a wait is removed
def _no_gather_wait(self: FlatParamHandle, streams: CommContext | None = None) -> None:
    self._pending_unshard = None  # forgets the all-gather's event: compute no longer waits for it


def _drops_keepalive() -> Callable[..., Any]:
    real = gradients_module.InFlight

    def make(pending: Any, event: Any, keepalive: Any, host: Any = None) -> Any:
        return real(pending, event, None, host)  # the unsharded gradient may be freed while reduced

    return make


SABOTAGE: dict[str, tuple[dict[str, Any], str]] = {
    "gather_wait": ({}, "wait_unshard"),
    "keepalive": ({}, "InFlight"),
    "offload_host_wait": ({"cpu_offload": True}, "sync_host"),
}


def _sabotaged(rank: int, world: int) -> dict[str, list[str]]:
    out = {}
    for name, (options, target) in SABOTAGE.items():
        with pytest.MonkeyPatch.context() as mp:
            if target == "wait_unshard":
                mp.setattr(FlatParamHandle, "wait_unshard", _no_gather_wait)
            elif target == "InFlight":
                mp.setattr(gradients_module, "InFlight", _drops_keepalive())
            else:
                mp.setattr(CommContext, "sync_host", lambda self, stream: None)
            _, (rec, _) = _trained(rank, world, options, fake=True)
        out[name] = rec.violations
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checker_reports_a_removed_wait() -> None:
    for r in spawn(_sabotaged, 2):
        gather = r["gather_wait"]
        assert any(v.startswith("compute reads") and "all_gather on unshard" in v for v in gather), gather
        assert any("freed (memory.free_storage)" in v and "all_gather on unshard" in v for v in gather), (
            gather
        )
        keep = r["keepalive"]
        assert any(
            "freed (its last reference dropped)" in v and "reduce_scatter on post_backward" in v for v in keep
        ), keep
        offload = r["offload_host_wait"]
        assert any(v.startswith(f"{HOST} reads") and "_copy_to_host" in v for v in offload), offload
