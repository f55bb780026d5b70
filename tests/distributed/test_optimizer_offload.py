"""``cpu_offload="optimizer"`` through ``shard()`` on 2 gloo ranks (see [Note: optimizer offload]).

On a CPU device the offloaded step runs the same code as on CUDA, with synchronous copies: each step the
optimizer runs on the host copies (checked with a step hook of the test's own), never on the device shards, and
training is exactly the run without offload (same kernels, same order) and within 1e-5 of the unsharded model:
weights, optimizer state and losses, for AdamW (default, foreach, fused), SGD with momentum, bf16 mixed precision,
accumulation (sharded and ``no_sync``), clipping, frozen parameters, several optimizers and param groups, and an
optimizer built before ``shard()``. State dicts and checkpoint files are those of a run without offload, and round
trip across offload and no offload.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch

import flatshard
from flatshard.engine import handle_of_param, state_device, unit_states
from flatshard.testing import spawn
from flatshard.testing.models import Block, TinyGPT, make_batch

PER_RANK = 2
STEPS = 3
FROZEN = ("wpe.weight", "blocks.1.ln1.weight", "blocks.1.ln1.bias")


def _optimizers(model: torch.nn.Module, name: str) -> list[torch.optim.Optimizer]:
    params = list(model.parameters())
    if name == "adamw":
        return [torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)]
    if name == "adamw_foreach":
        return [torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)]
    if name == "adamw_fused":
        return [torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)]
    if name == "sgd":
        return [torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)]
    if name == "frozen":
        return [torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-2)]
    if (
        name == "groups"
    ):  # decay on matrices only (by name: sharded pieces are 1-D), embeddings at their own rate
        named = list(model.named_parameters())
        emb = [p for n, p in named if n.startswith(("wte", "wpe"))]
        rest = [(n, p) for n, p in named if not n.startswith(("wte", "wpe"))]
        matrix = [p for n, p in rest if n.endswith("weight") and ".ln" not in n and not n.startswith("ln")]
        return [
            torch.optim.AdamW(
                [
                    {"params": matrix, "weight_decay": 0.1},
                    {"params": [p for _, p in rest if all(p is not q for q in matrix)], "weight_decay": 0.0},
                    {"params": emb, "lr": 5e-3},
                ],
                lr=1e-2,
            )
        ]
    if name == "two":  # two optimizers over one unit's parameters (and others)
        half = len(params) // 2
        return [
            torch.optim.AdamW(params[:half], lr=1e-2),
            torch.optim.SGD(params[half:], lr=0.1, momentum=0.9),
        ]
    raise ValueError(name)


class HostCheck:
    """A step pre-hook of each optimizer (it runs after flatshard's global one): during the step every offloaded
    parameter with a gradient is its piece of its unit's host copies; after the step (:meth:`after_step`), its
    device piece again, and its state in host memory."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.during: list[bool] = []
        self.after: list[bool] = []
        for opt in optimizers:
            opt.register_step_pre_hook(self.pre)

    @staticmethod
    def _params(opt: torch.optim.Optimizer) -> list[tuple[torch.Tensor, Any]]:
        out = []
        for g in opt.param_groups:
            for p in g["params"]:
                handle = handle_of_param(p)
                if handle is not None and handle.host is not None and p.grad is not None and p.numel():
                    out.append((p, handle))
        return out

    def pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for p, handle in self._params(opt):
            i = handle.index_of(p)
            self.during.append(
                p.data_ptr() == handle.piece_of(handle.host.params, i).data_ptr()
                and p.grad.data_ptr() == handle.piece_of(handle.host.grads, i).data_ptr()
            )

    def after_step(self, opt: torch.optim.Optimizer) -> None:
        for p, handle in self._params(opt):
            i = handle.index_of(p)
            self.after.append(
                p.data_ptr() == handle.piece(i).data_ptr()
                and p.grad.data_ptr() == handle.piece_of(handle.sharded_grad(), i).data_ptr()
            )
        for g in opt.param_groups:
            for p in g["params"]:
                for value in opt.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor):
                        self.after.append(value.device == state_device(p))


def _batch(rank: int, world: int, n: int, sharded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    idx, tgt = make_batch(n, PER_RANK * world)
    if sharded:
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        return idx[mine], tgt[mine]
    return idx, tgt


def _train(
    rank: int,
    world: int,
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    sharded: bool,
    steps: range,
    micro: int = 2,
    use_no_sync: bool = False,
    clip: float | None = 0.5,
    check: HostCheck | None = None,
) -> list[float]:
    losses = []
    for step in steps:
        for m in range(micro):
            idx, tgt = _batch(rank, world, 10 * step + m, sharded)
            quiet = sharded and use_no_sync and m < micro - 1
            with flatshard.no_sync(model) if quiet else _nothing():
                loss = model.loss(idx, tgt)
                loss.backward()
            losses.append(loss.item())
        if clip is not None:
            if sharded:
                flatshard.clip_grad_norm_(model, clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            if check is not None:
                check.after_step(opt)
            opt.zero_grad()
    return losses


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _model(case: dict[str, Any], offload: bool | str | None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = TinyGPT()
    if case.get("frozen"):
        for name, p in model.named_parameters():
            p.requires_grad_(name not in FROZEN)
    if offload is None:
        return model
    options = {k: v for k, v in case.items() if k in ("sharding_strategy", "mixed_precision")}
    return flatshard.shard(model, auto_wrap_policy={Block}, cpu_offload=offload, **options)


def _model_and_optimizers(
    case: dict[str, Any], offload: bool | str | None
) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    if not case.get("built_before") or offload is None:
        model = _model(case, offload)
        return model, _optimizers(model, case["optimizer"])
    unsharded = _model(case, None)  # the optimizer first, over the unsharded parameters: shard() keeps them
    optimizers = _optimizers(unsharded, case["optimizer"])
    options = {k: v for k, v in case.items() if k in ("sharding_strategy", "mixed_precision")}
    return flatshard.shard(unsharded, auto_wrap_policy={Block}, cpu_offload=offload, **options), optimizers


def _run_case(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    runs: dict[str, Any] = {}
    for offload in ("optimizer", False, None):  # None: the unsharded reference on the global batch
        model, optimizers = _model_and_optimizers(case, offload)
        check = HostCheck(optimizers) if offload == "optimizer" else None
        losses = _train(
            rank,
            world,
            model,
            optimizers,
            offload is not None,
            range(STEPS),
            micro=case.get("micro", 2),
            use_no_sync=case.get("no_sync", False),
            check=check,
        )
        if offload is None:
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            optim = [o.state_dict() for o in optimizers]
        else:
            weights, optim = flatshard.get_state_dict(model, optimizers, rank0_only=False)
        runs[str(offload)] = {
            "weights": weights,
            "optim": optim,
            "losses": losses,
            "during": check.during if check else [],
            "after": check.after if check else [],
        }
    return runs


def _max_diff(a: Any, b: Any) -> float:
    if isinstance(a, torch.Tensor):
        return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    if isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), (sorted(a, key=str), sorted(b, key=str))
        return max((_max_diff(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, list):
        assert len(a) == len(b)
        return max((_max_diff(x, y) for x, y in zip(a, b)), default=0.0)
    assert a == b, (a, b)
    return 0.0


def _check_case(name: str, case: dict[str, Any], runs: dict[str, Any]) -> None:
    mine, plain, reference = runs["optimizer"], runs["False"], runs["None"]
    assert mine["during"] and all(mine["during"]), (name, "the step did not run on the host copies")
    assert mine["after"] and all(mine["after"]), (name, "device pieces or host state missing after the step")
    # offload changes where the step runs, not its arithmetic: the run without offload, bit for bit
    assert mine["losses"] == plain["losses"], name
    assert _max_diff(mine["weights"], plain["weights"]) == 0.0, name
    assert _max_diff(mine["optim"], plain["optim"]) == 0.0, name
    if case.get("mixed_precision") is None:  # and the unsharded model, within rounding
        assert _max_diff(mine["weights"], reference["weights"]) <= 1e-5, name
        assert _max_diff(mine["optim"], reference["optim"]) <= 1e-5, name


QUICK = {"adamw_accumulate_clip": {"optimizer": "adamw"}}
MATRIX = {
    "adamw_foreach": {"optimizer": "adamw_foreach"},
    "adamw_fused": {"optimizer": "adamw_fused"},
    "sgd_momentum": {"optimizer": "sgd"},
    "bf16": {"optimizer": "adamw_fused", "mixed_precision": {"param_dtype": torch.bfloat16}},
    "no_sync": {"optimizer": "adamw", "no_sync": True, "micro": 3},
    "shard_grad_op": {"optimizer": "adamw", "sharding_strategy": "SHARD_GRAD_OP"},
    "no_shard": {"optimizer": "sgd", "sharding_strategy": "NO_SHARD"},
    "frozen": {"optimizer": "frozen", "frozen": True},
    "param_groups": {"optimizer": "groups"},
    "two_optimizers": {"optimizer": "two"},
    "built_before_shard": {"optimizer": "adamw_fused", "built_before": True},
}


def _run_cases(rank: int, world: int, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {name: _run_case(rank, world, case) for name, case in cases.items()}


@pytest.mark.timeout(300)
def test_offloaded_step_equals_the_step_on_the_device() -> None:
    for result in spawn(_run_cases, 2, QUICK):
        for name, case in QUICK.items():
            _check_case(name, case, result[name])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_offloaded_step_matrix() -> None:
    for result in spawn(_run_cases, 2, MATRIX):
        for name, case in MATRIX.items():
            _check_case(name, case, result[name])


# ---------------------------------------------------------------------------------------------- state round trips
def _fresh(offload: bool | str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model({}, offload)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _round_trips(rank: int, world: int, tmp: str) -> dict[str, float]:
    torch.set_num_threads(1)
    out: dict[str, float] = {}
    finals: dict[str, dict[str, torch.Tensor]] = {}
    for offload in ("optimizer", False):  # four steps in one go: what every resumed run must reach
        model, opt = _fresh(offload)
        _train(rank, world, model, [opt], True, range(4), micro=1)
        finals[str(offload)], _ = flatshard.get_state_dict(model, opt, rank0_only=False)
    out["continuous"] = _max_diff(finals["optimizer"], finals["False"])
    for first, then in (("optimizer", False), (False, "optimizer"), ("optimizer", "optimizer")):
        for how in ("state_dict", "sharded_state_dict", "full_file", "directory"):
            model, opt = _fresh(first)
            _train(rank, world, model, [opt], True, range(2), micro=1)
            resumed, new_opt = _fresh(then)
            path = os.path.join(tmp, f"{first}-{then}-{how}")
            if how in ("state_dict", "sharded_state_dict"):
                full = how == "state_dict"
                state, optim = flatshard.get_state_dict(model, opt, full=full, rank0_only=False)
                flatshard.set_state_dict(resumed, new_opt, state, optim, full=full)
            else:
                kind = "full" if how == "full_file" else "sharded"
                flatshard.save_checkpoint(path, model, opt, state_dict_type=kind)
                flatshard.load_checkpoint(path, resumed, new_opt)
            _train(rank, world, resumed, [new_opt], True, range(2, 4), micro=1)
            final, _ = flatshard.get_state_dict(resumed, new_opt, rank0_only=False)
            out[f"{first}->{then} {how}"] = _max_diff(final, finals["False"])
    # the same training writes the same files with and without offload
    for offload in ("optimizer", False):
        model, opt = _fresh(offload)
        _train(rank, world, model, [opt], True, range(2), micro=1)
        flatshard.save_checkpoint(os.path.join(tmp, f"file-{offload}.ckpt"), model, opt)
    if rank == 0:
        a = torch.load(os.path.join(tmp, "file-optimizer.ckpt"), weights_only=True)
        b = torch.load(os.path.join(tmp, "file-False.ckpt"), weights_only=True)
        out["same_file"] = _max_diff(a, b)
    return out


def _plain_load(rank: int, world: int) -> dict[str, Any]:
    """torch's own ``optimizer.load_state_dict`` (this rank's pieces, as ``state_dict()`` gave them): into an
    optimizer flatshard has seen (its load hooks put the state in host memory and the parameters back on their
    device pieces) and into one it has not (the next step moves the state); training goes on as before."""
    torch.set_num_threads(1)
    model, opt = _fresh("optimizer")
    _train(rank, world, model, [opt], True, range(2), micro=1)
    local = copy.deepcopy(opt.state_dict())
    out: dict[str, Any] = {}
    twins = []
    for seen in (True, False):
        twin, twin_opt = _fresh("optimizer")
        twin.load_state_dict(model.state_dict())
        if seen:
            flatshard.get_state_dict(
                twin, twin_opt, full=False
            )  # flatshard sees it: its load hooks are in place
        twin_opt.load_state_dict(copy.deepcopy(local))  # torch keeps the tensors it is given
        out[f"pieces/{seen}"] = all(
            p.data_ptr() == h.piece(h.index_of(p)).data_ptr()
            for p in twin.parameters()
            for h in [handle_of_param(p)]
            if h is not None
        )
        out[f"state/{seen}"] = _max_diff(twin_opt.state_dict()["state"], local["state"])
        twins.append((twin, twin_opt))
    _train(rank, world, model, [opt], True, range(2, 4), micro=1)
    a, _ = flatshard.get_state_dict(model, rank0_only=False)
    for seen, (twin, twin_opt) in zip((True, False), twins):
        _train(rank, world, twin, [twin_opt], True, range(2, 4), micro=1)
        b, _ = flatshard.get_state_dict(twin, rank0_only=False)
        out[f"diff/{seen}"] = _max_diff(a, b)
        out[f"host/{seen}"] = all(
            v.device == state_device(p) for p in twin.parameters() for v in twin_opt.state[p].values()
        )
    return out


@pytest.mark.timeout(600)
def test_state_round_trips_across_offload(tmp_path: Any) -> None:
    for r in spawn(_round_trips, 2, str(tmp_path)):
        for key, value in r.items():
            assert value <= 1e-6, (key, r)
        assert "continuous" in r


@pytest.mark.timeout(300)
def test_torch_load_state_dict_keeps_state_on_the_host() -> None:
    for r in spawn(_plain_load, 2):
        for seen in (True, False):
            assert r[f"pieces/{seen}"] and r[f"host/{seen}"], r
            assert r[f"state/{seen}"] == 0.0 and r[f"diff/{seen}"] == 0.0, r


# ---------------------------------------------------------------------------------------------- refusals
def test_bad_values_and_refused_combinations() -> None:
    with pytest.raises(ValueError, match="cpu_offload='gpu' is not an offload mode"):
        flatshard.ShardOptions(cpu_offload="gpu")
    with pytest.raises(TypeError, match="CPUOffload flags must be bools"):
        flatshard.CPUOffload(offload_optimizer="yes")  # type: ignore[arg-type]
    assert flatshard.ShardOptions(cpu_offload="Optimizer").cpu_offload == "optimizer"
    both = flatshard.CPUOffload(offload_params=True, offload_optimizer=True)
    assert (
        flatshard.ShardOptions(cpu_offload=both).cpu_offload is True
    )  # params offload keeps the optimizer there
    options = flatshard.ShardOptions(cpu_offload=flatshard.CPUOffload(offload_optimizer=True))
    assert options.cpu_offload == "optimizer" and options.offload_optimizer and not options.offload_params

    model = flatshard.shard(TinyGPT(), cpu_offload="optimizer")  # one process: no process group
    handle = unit_states(model)[0].handles[0]
    assert handle.host is not None and not handle.offload
    model.loss(*make_batch(0, 2)).backward()
    capturable = torch.optim.Adam(model.parameters(), capturable=True)
    with pytest.raises(ValueError, match="capturable=True"):
        capturable.step()
    muon_params = [p for p in model.parameters() if p.dim() == 2]
    for p in model.parameters():
        p.grad = None
    if hasattr(torch.optim, "Muon"):
        model.loss(*make_batch(0, 2)).backward()
        with pytest.raises(ValueError, match="needs each parameter whole"):
            torch.optim.Muon(muon_params).step()
