"""Prefetching: gathers are issued ahead in the recorded order; a changed order falls back safely."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import flatshard
from flatshard.engine.handle import FlatParamHandle, HandleState
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch


def _trace_events(model: TinyGPT, backward_prefetch, forward_prefetch: bool) -> list[tuple[str, str]]:
    """Run 2 iterations and return the 2nd's (event, unit) sequence of gathers and reductions."""
    names = {id(b.__dict__["_flatshard_state"].handles[0]): f"b{i}" for i, b in enumerate(model.blocks)}
    names[id(model.__dict__["_flatshard_state"].handles[0])] = "root"
    log: list[tuple[str, str]] = []
    orig_unshard, orig_reduce = FlatParamHandle.unshard, FlatParamHandle.reduce_grad

    def unshard(self, *args, **kwargs):
        if self.state is HandleState.SHARDED:
            log.append(("gather", names[id(self)]))
        return orig_unshard(self, *args, **kwargs)

    def reduce_grad(self, *args, **kwargs):
        log.append(("reduce", names[id(self)]))
        return orig_reduce(self, *args, **kwargs)

    for i, blk in enumerate(model.blocks):  # user hooks run after flatshard's (which are prepended)
        blk.register_forward_pre_hook(lambda *_, i=i: log.append(("forward", f"b{i}")))
    FlatParamHandle.unshard, FlatParamHandle.reduce_grad = unshard, reduce_grad
    try:
        for step in range(2):
            log.clear()
            idx, tgt = make_batch(step, 2)
            loss = model.loss(idx, tgt)
            log.append(("backward", "start"))
            loss.backward()
    finally:
        FlatParamHandle.unshard, FlatParamHandle.reduce_grad = orig_unshard, orig_reduce
    return log


def _before(log: list[tuple[str, str]], a: tuple[str, str], b: tuple[str, str], phase: str) -> bool:
    """Whether ``a`` comes before ``b`` within the forward or the backward part of ``log``."""
    split = log.index(("backward", "start"))
    part = log[:split] if phase == "forward" else log[split:]
    return part.index(a) < part.index(b)


class Branchy(TinyGPT):
    """Skips block 1 on odd calls: a data-dependent order change."""

    calls = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        Branchy.calls += 1
        pos = torch.arange(idx.shape[1])
        h = self.wte(idx) + self.wpe(pos)
        for i, blk in enumerate(self.blocks):
            if i == 1 and Branchy.calls % 2 == 0:
                continue
            h = blk(h)
        return self.head(self.ln_f(h))


def _run(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    for label, bwd, fwd in (("pre", "BACKWARD_PRE", False), ("none", None, False), ("fwd", None, True)):
        torch.manual_seed(0)
        model = TinyGPT(n_layer=3)
        flatshard.shard(model, auto_wrap_policy={Block}, backward_prefetch=bwd, forward_prefetch=fwd)
        out[label] = _trace_events(model, bwd, fwd)

    torch.manual_seed(0)
    reference = Branchy()
    model = copy.deepcopy(reference)
    flatshard.shard(model, auto_wrap_policy={Block}, forward_prefetch=True)
    opt, ref_opt = (
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.optim.SGD(reference.parameters(), lr=0.1),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            idx, tgt = make_batch(step, 2 * world)
            Branchy.calls = step  # the same branch for the model and the reference
            reference.loss(idx, tgt).backward()
            Branchy.calls = step
            model.loss(idx[2 * rank : 2 * rank + 2], tgt[2 * rank : 2 * rank + 2]).backward()
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    out["order_warnings"] = sum("order of unit" in str(w.message) for w in caught)
    full, _ = flatshard.get_state_dict(model, rank0_only=False)
    out["branchy_err"] = max(
        (full[k] - v).abs().max().item() for k, v in reference.state_dict().items() if v.is_floating_point()
    )
    return out


@pytest.mark.timeout(300)
def test_prefetch_order_and_fallback() -> None:
    for r in spawn(_run, 2):
        pre, none, fwd = r["pre"], r["none"], r["fwd"]
        # BACKWARD_PRE: block 1 is gathered while block 2's gradient is still being computed.
        assert _before(pre, ("gather", "b1"), ("reduce", "b2"), "backward"), pre
        assert _before(pre, ("gather", "b0"), ("reduce", "b1"), "backward"), pre
        # Without prefetch each block is gathered only after the previous one's reduction started.
        assert _before(none, ("reduce", "b2"), ("gather", "b1"), "backward"), none
        assert _before(none, ("reduce", "b1"), ("gather", "b0"), "backward"), none
        # Forward prefetch: block 1 is gathered before block 0 computes; without it, only after.
        assert _before(fwd, ("gather", "b1"), ("forward", "b0"), "forward"), fwd
        assert _before(none, ("forward", "b0"), ("gather", "b1"), "forward"), none
        assert r["order_warnings"] == 1, r["order_warnings"]
        assert r["branchy_err"] < 1e-5, r["branchy_err"]
