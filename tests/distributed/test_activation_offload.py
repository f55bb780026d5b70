"""``activation_offload=True`` through ``shard()`` on gloo ranks (see [Note: activation offload]).

On CPU the hooks run without copies, so training with them must be training without them bit for bit: the
same losses, gradients and weights after a few steps from the same seed, for every sharding strategy, mixed
precision, CPU offload, activation checkpointing (full and selective) and a tiny Hugging Face Llama; the
counters say the hooks ran, moved tensors and brought them back one unit ahead. The CUDA protocol of the
copies (which stream copies, what waits for what, nothing freed early, no blocking copy) is checked on CPU by
the recording fake of ``tests/fake_streams.py``, and taking a wait out of the engine makes that check fail.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

import flatshard
from flatshard.engine import activation_offload as offload_module
from flatshard.engine import activation_offload_stats, unit_states
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch
from tests.fake_streams import record_streams

PER_RANK = 2
STEPS = 3
BF16 = {"param_dtype": torch.bfloat16}


def _build(model_name: str) -> tuple[nn.Module, type[nn.Module], Callable[[nn.Module, Any], torch.Tensor]]:
    """The model (seeded), its block class, and its loss on a batch."""
    if model_name == "hf_llama":
        from tests.hf.hf_common import tiny_llama  # transformers: only where a case needs it

        model, block = tiny_llama()
        return model, block, lambda m, b: m(input_ids=b[0], labels=b[0]).loss
    torch.manual_seed(0)
    model = TinyGPT(d_model=16, n_layer=3)
    return model, Block, lambda m, b: m.loss(b[0], b[1])


def _batch(model_name: str, step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    if model_name == "hf_llama":
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(3, 64, (PER_RANK * world, 12), generator=g)
        return ids, ids
    return make_batch(step, PER_RANK * world)


def _train(rank: int, world: int, model_name: str, options: dict[str, Any], offload: bool) -> dict[str, Any]:
    """``STEPS`` AdamW steps on this rank's slice of each global batch; losses, last gradients, weights."""
    model, block, loss_of = _build(model_name)
    if options.get("activation_checkpointing_policy") == "block":  # the model's block class
        options = {**options, "activation_checkpointing_policy": {block}}
    flatshard.shard(model, auto_wrap_policy={block}, activation_offload=offload, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    losses, grads = [], {}
    for step in range(STEPS):
        batch = tuple(t[mine] for t in _batch(model_name, step, world))
        loss = loss_of(model, batch)
        loss.backward()
        losses.append(loss.item())
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    weights, _ = flatshard.get_state_dict(model, rank0_only=False)
    stats = activation_offload_stats(model)
    assert stats is not None
    return {"losses": losses, "grads": grads, "weights": weights, "stats": stats}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _compare(rank: int, world: int, cases: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {}
    for name, (model_name, options) in cases.items():
        plain = _train(rank, world, model_name, options, offload=False)
        moved = _train(rank, world, model_name, options, offload=True)
        out[name] = {
            "losses": moved["losses"] == plain["losses"],
            "grads": _same(moved["grads"], plain["grads"]) and bool(moved["grads"]),
            "weights": _same(moved["weights"], plain["weights"]),
            "stats": moved["stats"],
            "plain_stats": plain["stats"],
        }
    return out


def _assert_parity(results: list[dict[str, Any]], cases: dict[str, Any]) -> None:
    for rank, result in enumerate(results):
        for name, (model_name, options) in cases.items():
            r = result[name]
            assert r["losses"] and r["grads"] and r["weights"], (rank, name, r)
            s = r["stats"]
            # the hooks ran, moved tensors and brought every record back ahead of its unit's backward
            assert s.packed > s.moved > 0 and s.unpacked > 0, (rank, name, s)
            assert s.records > 0 and s.prefetched > 0 and s.late == 0, (rank, name, s)
            assert s.max_units_in_flight <= 2 and s.max_units_back <= 2, (rank, name, s)
            assert len(s.unit_bytes) == 3, (rank, name, s.unit_bytes)  # the three blocks
            if options.get("activation_checkpointing_policy"):
                # what reaches the offload is what the checkpoints save outside themselves: a block's input
                hidden = PER_RANK * (12 * 32 if model_name == "hf_llama" else 7 * 16) * 4
                middle = [v for k, v in s.unit_bytes.items() if k.endswith(".1")]
                assert middle == [hidden], (rank, name, s.unit_bytes)
            assert r["plain_stats"].packed == 0, (rank, name)  # off: no hooks at all


QUICK = {
    "full_shard": ("tiny", {}),
    "checkpointed": ("tiny", {"activation_checkpointing_policy": "block"}),
}
MATRIX = {
    "hf_llama": ("hf_llama", {}),
    "shard_grad_op": ("tiny", {"sharding_strategy": "SHARD_GRAD_OP"}),
    "no_shard": ("tiny", {"sharding_strategy": "NO_SHARD"}),
    "bf16": ("tiny", {"mixed_precision": BF16}),
    "cpu_offload": ("tiny", {"cpu_offload": True}),
    "prefetch_both": ("tiny", {"forward_prefetch": True, "backward_prefetch": "BACKWARD_POST"}),
    "selective": (
        "tiny",
        {"activation_checkpointing_policy": "block", "activation_checkpointing_mode": "selective"},
    ),
    "hf_llama_checkpointed": ("hf_llama", {"activation_checkpointing_policy": "block"}),
}


@pytest.mark.timeout(300)
def test_activation_offload_changes_nothing_on_cpu() -> None:
    _assert_parity(spawn(_compare, 2, QUICK), QUICK)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_activation_offload_matrix() -> None:
    _assert_parity(spawn(_compare, 2, MATRIX), MATRIX)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_activation_offload_hybrid() -> None:
    cases = {"hybrid": ("tiny", {"sharding_strategy": "HYBRID_SHARD", "shard_group_size": 2})}
    _assert_parity(spawn(_compare, 4, cases), cases)


def test_reference_parity_and_unsharded_root_warning(caplog: pytest.LogCaptureFixture) -> None:
    """One process, no process group: offloaded training equals the unsharded model's; a model that is its only
    unit offloads nothing, and says so."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    reference = TinyGPT()
    model = copy.deepcopy(reference)
    flatshard.shard(model, auto_wrap_policy={Block}, activation_offload=True)
    for m in (model, reference):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(2):
            m.loss(*make_batch(step, 4)).backward()
            opt.step()
            opt.zero_grad()
    full, _ = flatshard.get_state_dict(model)
    assert max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items()) <= 1e-6
    single = flatshard.shard(TinyGPT(), activation_offload=True)
    with caplog.at_level("WARNING", logger="flatshard.engine.activation_offload"):
        single.loss(*make_batch(0, 4)).backward()
    stats = activation_offload_stats(single)
    assert stats is not None and stats.records == 0 and stats.packed > 0
    assert "nothing is offloaded" in caplog.text and "auto_wrap_policy" in caplog.text


def test_retained_graph_and_forward_without_backward() -> None:
    """A second backward through a retained graph copies the records back as it needs them (``late``); a forward
    without backward leaves nothing behind for the next step; two forwards before one backward train alike."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = TinyGPT()
    model = copy.deepcopy(plain)
    flatshard.shard(plain, auto_wrap_policy={Block})
    flatshard.shard(model, auto_wrap_policy={Block}, activation_offload=True)
    batch, other = make_batch(0, 4), make_batch(1, 4)
    grads = []
    for m in (plain, model):
        m.loss(*batch)  # no backward
        loss = m.loss(*batch)
        loss.backward(retain_graph=True)
        loss.backward()
        (m.loss(*batch) + m.loss(*other)).backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    assert _same(grads[0], grads[1])
    stats = activation_offload_stats(model)
    assert stats is not None and stats.late > 0 and stats.prefetched > 0
    root = unit_states(model)[0].ctx
    assert root is not None and not root.activations._back and not root.activations._in_flight


# ---------------------------------------------------------------------- the CUDA protocol, on CPU
PROTOCOL = {
    "offload": {},
    "checkpointed_bf16": {"activation_checkpointing_policy": {Block}, "mixed_precision": BF16},
}
PROTOCOL_MORE = {
    "cpu_offload": {"cpu_offload": True, "forward_prefetch": True},
    "shard_grad_op": {"sharding_strategy": "SHARD_GRAD_OP"},
}


def _protocol_steps(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int) -> list[float]:
    """Two optimizer steps, the second over two accumulated micro-batches."""
    losses = []
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for step, micro in ((0, 1), (1, 2)):
        for m in range(micro):
            idx, tgt = make_batch(10 * step + m, PER_RANK * world)
            loss = model.loss(idx[mine], tgt[mine])
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def _protocol_run(rank: int, world: int, options: dict[str, Any], fake: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = flatshard.shard(TinyGPT(), auto_wrap_policy={Block}, activation_offload=True, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if not fake:
        return {"losses": _protocol_steps(model, opt, rank, world), "weights": _weights(model)}
    with record_streams(model) as rec:
        losses = _protocol_steps(model, opt, rank, world)
    return {
        "losses": losses,
        "weights": _weights(model),
        "violations": rec.violations,
        "blocking": rec.blocking,
        "d2h": sorted(rec.kinds_on("d2h")),
        "h2d": sorted(rec.kinds_on("h2d")),
        "stats": activation_offload_stats(model),
    }


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return flatshard.get_state_dict(model, rank0_only=False)[0]


def _protocol(rank: int, world: int, configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    torch.set_num_threads(1)
    # the fake's tensors are tiny: move every size, so that every saved tensor takes the copy path
    offload_module.ActivationOffload.min_bytes = 0
    out = {}
    for name, options in configs.items():
        fake = _protocol_run(rank, world, options, fake=True)
        real = _protocol_run(rank, world, options, fake=False)
        fake["same"] = fake["losses"] == real["losses"] and _same(fake["weights"], real["weights"])
        out[name] = {k: v for k, v in fake.items() if k not in ("losses", "weights")}
    return out


def _assert_protocol(results: list[dict[str, Any]], configs: dict[str, dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        for name, options in configs.items():
            r = result[name]
            assert r["violations"] == [] and r["blocking"] == [], (rank, name, r["violations"], r["blocking"])
            assert r["same"], (rank, name)  # the CUDA paths give what the CPU paths give
            host = bool(options.get("cpu_offload"))
            assert r["d2h"] == (["offload", "post_backward"] if host else ["offload"]), (rank, name, r["d2h"])
            assert r["h2d"] == (["pre_unshard", "reload"] if host else ["reload"]), (rank, name, r["h2d"])
            s = r["stats"]
            assert s.records > 0 and s.prefetched > 0 and s.late == 0, (rank, name, s)
            assert s.max_units_in_flight <= 2 and s.max_units_back <= 2, (rank, name, s)


@pytest.mark.timeout(600)
def test_offload_stream_protocol() -> None:
    _assert_protocol(spawn(_protocol, 2, PROTOCOL), PROTOCOL)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_offload_stream_protocol_more() -> None:
    _assert_protocol(spawn(_protocol, 2, PROTOCOL_MORE), PROTOCOL_MORE)


def _without_reload_wait(original: Callable[..., bool]) -> Callable[..., bool]:
    def copy_back(self: Any, record: Any) -> bool:
        done = original(self, record)
        record.waited = True  # the compute stream never waits for the copy back
        return done

    return copy_back


def _drop_without_wait(self: Any, record: Any) -> None:
    """``_release`` without the compute stream's wait: the device storages are dropped as the copy reads them."""
    if record in self._in_flight:
        self._in_flight.remove(record)
    if record in self._back:
        self._back.remove(record)
    record.device, record.phase = [], offload_module._Phase.ON_HOST


def _sabotaged(rank: int, world: int) -> dict[str, list[str]]:
    torch.set_num_threads(1)
    offload_module.ActivationOffload.min_bytes = 0
    cls = offload_module.ActivationOffload
    out = {}
    for name, (attr, replacement) in {
        "reload_wait": ("_copy_back", _without_reload_wait(cls._copy_back)),
        "release_wait": ("_release", _drop_without_wait),
    }.items():
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cls, attr, replacement)
            torch.manual_seed(0)
            model = flatshard.shard(TinyGPT(), auto_wrap_policy={Block}, activation_offload=True)
            with record_streams(model) as rec:
                idx, tgt = make_batch(0, PER_RANK)
                model.loss(idx, tgt).backward()
        out[name] = rec.violations
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_checker_reports_a_removed_offload_wait() -> None:
    for r in spawn(_sabotaged, 2):
        reload = r["reload_wait"]
        assert any(v.startswith("compute reads") and "on reload" in v for v in reload), reload
        release = r["release_wait"]
        assert any("freed (its last reference dropped)" in v and "on offload" in v for v in release), release


# ---------------------------------------------------------------------- torch.compile
def _compiled(rank: int, world: int, checkpointed: bool) -> dict[str, Any]:
    """Compiled units (``aot_eager``: dynamo and AOTAutograd as with inductor, without its C++ build) with and
    without the offload: the same training, no graph break, nothing recompiled after the first step."""
    from flatshard.engine import compile_units
    from flatshard.testing.dynamo import watch_dynamo

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for offload in (False, True):
        with watch_dynamo() as watch:
            torch.manual_seed(0)
            model = flatshard.shard(
                TinyGPT(),
                auto_wrap_policy={Block},
                activation_offload=offload,
                activation_checkpointing_policy={Block} if checkpointed else None,
            )
            compile_units(model, {"backend": "aot_eager"})
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            losses = []
            for step in range(STEPS):
                idx, tgt = make_batch(step, PER_RANK * world)
                loss = model.loss(idx[mine], tgt[mine])
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                watch.step()
            out[str(offload)] = {
                "losses": losses,
                "weights": _weights(model),
                "stats": activation_offload_stats(model),
                **watch.summary(),
            }
    plain, moved = out["False"], out["True"]
    return {
        "same": plain["losses"] == moved["losses"] and _same(plain["weights"], moved["weights"]),
        "stats": moved["stats"],
        "breaks": moved["breaks"],
        "warnings": moved["warnings"],
        "graphs": moved["graphs"],
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("checkpointed", [False, True], ids=["units", "checkpointed_units"])
def test_compiled_units_with_offload(checkpointed: bool) -> None:
    for rank, r in enumerate(spawn(_compiled, 2, checkpointed)):
        assert r["same"], (rank, r)
        assert r["breaks"] == {} and r["warnings"] == [], (rank, r)
        assert r["graphs"][0] == r["graphs"][-1], (rank, r)  # compiled at the first step, then reused
        s = r["stats"]
        # the compiled graphs' saved tensors reach the hooks at the graphs' boundary, and move
        assert s.moved > 0 and s.prefetched > 0 and s.late == 0, (rank, s)


def test_cpu_memory_is_unchanged() -> None:
    """On CPU the records hold the storages themselves, and only as long as autograd does: the live bytes of a
    training step peak at the same value with the offload as without it."""
    from flatshard.estimator.tracker import StorageTracker

    torch.set_num_threads(1)
    peaks = []
    for offload in (False, True):
        torch.manual_seed(0)
        model = flatshard.shard(TinyGPT(d_model=32), auto_wrap_policy={Block}, activation_offload=offload)
        model.loss(*make_batch(0, 4)).backward()  # the first step records the order
        tracker = StorageTracker()
        tracker.watch([*model.parameters(), *(p.grad for p in model.parameters())])
        with tracker:
            model.loss(*make_batch(1, 4)).backward()
        peaks.append(tracker.peak)
    assert peaks[0] == peaks[1], peaks
