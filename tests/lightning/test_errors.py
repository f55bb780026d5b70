"""Errors: bad strategy names and arguments, features of later releases, bad checkpoints.

Construction errors are checked in the pytest process (building a Trainer starts nothing). Checkpoint errors
need a sharded model, so they run on 2 ranks: each bad ``fit(ckpt_path=...)`` must fail on every rank with an
error naming the file, leave the sharded weights untouched, and leave the ranks able to resume correctly.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import flatshard
from flatshard.checkpoint.files import CheckpointError
from flatshard.testing import spawn
from flatshard.testing.models import Block

from .lit_common import LitGPT, load_ckpt, make_loader, make_trainer, train_reference


def _trainer(**kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 2,
        "logger": False,
        "enable_progress_bar": False,
    }
    options.update(kwargs)
    return L.Trainer(**options)


# ---------------------------------------------------------------- names and arguments
@pytest.mark.timeout(300)
def test_registered_names_build_the_flatshard_strategy() -> None:
    for name in ("flatshard", "flatshard_grad_op", "flatshard_hybrid", "flatshard_offload"):
        assert name in StrategyRegistry, name
    full = _trainer(strategy="flatshard").strategy
    grad_op = _trainer(strategy="flatshard_grad_op").strategy
    assert isinstance(full, flatshard.FlatShardStrategy) and isinstance(grad_op, flatshard.FlatShardStrategy)
    assert full.sharding_strategy.name == "FULL_SHARD"
    assert grad_op.sharding_strategy.name == "SHARD_GRAD_OP"


@pytest.mark.timeout(300)
def test_unknown_strategy_name_is_named_in_the_error() -> None:
    with pytest.raises(ValueError, match="flatshard_zero9"):
        _trainer(strategy="flatshard_zero9")


@pytest.mark.timeout(300)
def test_hybrid_name_builds_a_hybrid_strategy() -> None:
    assert _trainer(strategy="flatshard_hybrid").strategy.sharding_strategy.name == "HYBRID_SHARD"


@pytest.mark.timeout(300)
def test_offload_name_builds_an_offloading_strategy() -> None:
    assert _trainer(strategy="flatshard_offload").strategy.options.shard.cpu_offload is True


@pytest.mark.timeout(300)
def test_unknown_sharding_strategy_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="FOO") as err:
        flatshard.FlatShardStrategy(sharding_strategy="FOO")
    for choice in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        assert choice in str(err.value)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cls", ["FlatShardStrategy", "FlatShardFabricStrategy"])
def test_every_bad_argument_is_listed_in_one_error(cls: str) -> None:
    with pytest.raises(ValueError) as info:
        getattr(flatshard, cls)(
            sharding_strategy="ZERO_4", forward_prefetch="yes", state_dict_type="zip", start_method="fork"
        )
    message = str(info.value)
    assert "4 options are wrong" in message, message
    for fragment in ("ZERO_4", "forward_prefetch", "state_dict_type='zip'", "start_method='fork'"):
        assert fragment in message, fragment


@pytest.mark.timeout(300)
def test_auto_wrap_policy_of_the_wrong_kind() -> None:
    with pytest.raises(TypeError, match="auto_wrap_policy"):
        flatshard.FlatShardStrategy(auto_wrap_policy=3.5)
    with pytest.raises(TypeError, match="auto_wrap_policy"):
        flatshard.FlatShardStrategy(auto_wrap_policy="Block")  # a bare string is not a set of classes
    with pytest.raises(ValueError, match="'Block' is not an import path"):
        flatshard.FlatShardStrategy(auto_wrap_policy={"Block"})
    with pytest.raises(TypeError, match="auto_wrap_policy"):
        flatshard.FlatShardStrategy(auto_wrap_policy={Block, 3})
    # The accepted spellings build.
    flatshard.FlatShardStrategy(auto_wrap_policy={"flatshard.testing.models.Block"})
    flatshard.FlatShardStrategy(auto_wrap_policy=1000)
    flatshard.FlatShardStrategy(
        auto_wrap_policy=lambda module, recurse, numel: recurse or isinstance(module, Block)
    )


BAD_HYBRID_ARGUMENTS = [
    ({"shard_group_size": 2}, ValueError, "only apply to HYBRID_SHARD"),
    ({"device_mesh": (1, 2)}, ValueError, "only apply to HYBRID_SHARD"),
    (
        {"sharding_strategy": "HYBRID_SHARD", "shard_group_size": 2, "device_mesh": (2, 2)},
        ValueError,
        "Give one of",
    ),
    ({"sharding_strategy": "HYBRID_SHARD", "shard_group_size": "2"}, TypeError, "positive int"),
    ({"sharding_strategy": "HYBRID_SHARD", "process_group": object()}, TypeError, "tuple"),
    ({"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 0)}, ValueError, "two positive ints"),
    ({"sharding_strategy": "HYBRID_SHARD", "device_mesh": "2x2"}, TypeError, "DeviceMesh"),
]


BAD_TENSOR_PARALLEL_ARGUMENTS = [
    ({"tensor_parallel_size": 0}, ValueError, "positive int or 'auto'"),
    ({"tensor_parallel_size": "2"}, ValueError, "positive int or 'auto'"),
    ({"data_parallel_size": 2}, ValueError, "needs tensor_parallel_size"),
    ({"tensor_parallel_size": 2, "data_parallel_size": -1}, ValueError, "data_parallel_size=-1"),
    ({"tensor_parallel_size": 2, "sharding_strategy": "HYBRID_SHARD"}, ValueError, "not supported"),
    ({"tensor_parallel_size": 2, "device_mesh": object()}, TypeError, "DeviceMesh"),
]


@pytest.mark.parametrize(
    "kwargs, error, match",
    BAD_TENSOR_PARALLEL_ARGUMENTS,
    ids=[f"tp-{i}" for i in range(len(BAD_TENSOR_PARALLEL_ARGUMENTS))],
)
def test_bad_tensor_parallel_arguments_are_refused(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        flatshard.FlatShardStrategy(**kwargs)


def test_tensor_parallel_sizes_must_cover_the_world() -> None:
    options = flatshard.FlatShardStrategy(tensor_parallel_size=3).options
    with pytest.raises(ValueError, match="must equal the world size"):
        options.mesh_shape(world_size=4, ranks_per_node=4)
    assert options.mesh_shape(world_size=6, ranks_per_node=6) == (
        (2, 3),
        ("data_parallel", "tensor_parallel"),
    )
    auto = flatshard.FlatShardStrategy(tensor_parallel_size="auto").options
    assert auto.mesh_shape(world_size=16, ranks_per_node=8) == ((2, 8), ("data_parallel", "tensor_parallel"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "kwargs, error, match",
    BAD_HYBRID_ARGUMENTS,
    ids=[f"hybrid-{i}" for i in range(len(BAD_HYBRID_ARGUMENTS))],
)
def test_bad_hybrid_arguments_are_refused(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        flatshard.FlatShardStrategy(**kwargs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "policy, error, match",
    [
        (True, TypeError, "a bool is not a policy"),
        ({"flatshard.testing.models.NoSuchBlock"}, (ImportError, ValueError), "NoSuchBlock"),
        ([3.5], TypeError, "not an nn.Module subclass"),
        (0, ValueError, "positive"),
    ],
)
def test_bad_activation_checkpointing_policy_is_refused(policy: Any, error: Any, match: str) -> None:
    with pytest.raises(error, match=match):
        flatshard.FlatShardStrategy(activation_checkpointing_policy=policy)


@pytest.mark.timeout(300)
def test_activation_checkpointing_policy_forms_reach_the_engine() -> None:
    for policy in ({Block}, ["flatshard.testing.models.Block"], Block, lambda m: isinstance(m, Block)):
        check = (
            flatshard.FlatShardStrategy(activation_checkpointing_policy=policy)
            .options.shard_options(torch.device("cpu"))
            .activation_checkpointing_policy
        )
        assert check(Block()) and not check(torch.nn.Linear(2, 2)), policy
    by_size = (
        flatshard.FlatShardStrategy(activation_checkpointing_policy=500)
        .options.shard_options(torch.device("cpu"))
        .activation_checkpointing_policy
    )
    assert by_size(torch.nn.Linear(30, 30)) and not by_size(torch.nn.Linear(3, 3))
    pickle.dumps(flatshard.FlatShardStrategy(activation_checkpointing_policy={Block}).options)


@pytest.mark.timeout(300)
def test_prefetch_options_are_validated_and_passed_to_the_engine() -> None:
    strategy = flatshard.FlatShardStrategy(backward_prefetch="backward_post", forward_prefetch=True)
    options = strategy.options.shard_options(torch.device("cpu"))
    assert options.backward_prefetch is flatshard.BackwardPrefetch.BACKWARD_POST
    assert options.forward_prefetch is True
    assert (
        flatshard.FlatShardStrategy().options.shard.backward_prefetch
        is flatshard.BackwardPrefetch.BACKWARD_PRE
    )
    with pytest.raises(ValueError, match="BACKWARD_PRE"):
        flatshard.FlatShardStrategy(backward_prefetch="SIDEWAYS")
    with pytest.raises(TypeError, match="forward_prefetch"):
        flatshard.FlatShardStrategy(forward_prefetch="yes")


@pytest.mark.timeout(300)
def test_defaults_of_later_features_are_accepted() -> None:
    strategy = flatshard.FlatShardStrategy(
        mixed_precision=None,
        cpu_offload=False,
        activation_checkpointing_policy=None,
        backward_prefetch=None,
        forward_prefetch=False,
        state_dict_type="full",
    )
    assert strategy.sharding_strategy.name == "FULL_SHARD"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["flatshard", "object"])
def test_precision_flags_map_onto_flatshard_precision(strategy: str) -> None:
    for precision in ("32-true", "bf16-mixed", "bf16-true", "16-true"):
        chosen: Any = flatshard.FlatShardStrategy() if strategy == "object" else strategy
        plugin = _trainer(strategy=chosen, precision=precision).strategy.precision_plugin
        assert type(plugin).__name__ == "FlatShardPrecision" and plugin.precision == precision
    with pytest.raises(ValueError, match="64-true"):
        _trainer(strategy="flatshard", precision="64-true")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "precision, param_dtype, match",
    [
        ("bf16-true", "fp32", "keeps the whole model in torch.bfloat16"),
        ("16-true", "bf16", "keeps the whole model in torch.float16"),
        ("bf16-mixed", "fp16", "autocast in torch.bfloat16"),
    ],
)
def test_precision_flag_that_contradicts_mixed_precision_is_refused(
    precision: str, param_dtype: str, match: str
) -> None:
    strategy = flatshard.FlatShardStrategy(mixed_precision={"param_dtype": param_dtype})
    with pytest.raises(ValueError, match=match):
        _trainer(strategy=strategy, precision=precision)
    fabric_strategy = flatshard.FlatShardFabricStrategy(mixed_precision={"param_dtype": param_dtype})
    with pytest.raises(ValueError, match=match):
        L.Fabric(accelerator="cpu", devices=2, strategy=fabric_strategy, precision=precision)  # type: ignore[arg-type]


@pytest.mark.timeout(300)
def test_precision_flag_that_agrees_with_mixed_precision_is_accepted() -> None:
    for precision, param_dtype in (("32-true", "bf16"), ("bf16-mixed", "fp32"), ("bf16-mixed", "bf16")):
        strategy = flatshard.FlatShardStrategy(mixed_precision={"param_dtype": param_dtype})
        assert (
            _trainer(strategy=strategy, precision=precision).strategy.precision_plugin.precision == precision
        )


@pytest.mark.timeout(300)
def test_empty_init_builds_on_the_meta_device() -> None:
    trainer = _trainer(strategy="flatshard")
    with trainer.init_module(empty_init=True):
        layer = torch.nn.Linear(2, 2)
    assert layer.weight.is_meta
    with pytest.raises(TypeError, match="param_init_fn must be a callable"):
        flatshard.FlatShardStrategy(param_init_fn=3)  # type: ignore[arg-type]


# ---------------------------------------------------------------- bad checkpoints, on 2 ranks
class TwoGroupsGPT(LitGPT):
    """Same model, but the optimizer has two parameter groups (LitGPT's has one)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        named = list(self.named_parameters())
        decay = [p for n, p in named if not n.endswith("bias")]
        no_decay = [p for n, p in named if n.endswith("bias")]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=self.lr)


def _bad_resumes(rank: int, world: int, cases: list[tuple[str, str]], valid: str) -> dict[str, Any]:
    initial = {k: v.clone() for k, v in LitGPT().state_dict().items()}
    out: dict[str, Any] = {}
    for name, path in cases:
        model = LitGPT()
        trainer = make_trainer(world, "flatshard", max_epochs=1)
        record: dict[str, Any] = {"raised": None}
        try:
            trainer.fit(model, make_loader(1, 2 * world, world), ckpt_path=path)
        except Exception as err:
            record.update(
                raised=type(err).__name__,
                message=str(err),
                is_checkpoint_error=isinstance(err, CheckpointError),
            )
        record["sharded"] = flatshard.is_sharded(model)
        full, _ = flatshard.get_state_dict(model, rank0_only=False)
        record["changed"] = sorted(k for k in initial if not torch.equal(full[k], initial[k]))
        record["keys_match"] = sorted(full) == sorted(initial)
        out[name] = record
    # The ranks are still usable: a valid resume right after the failures works.
    trainer = make_trainer(world, "flatshard", max_epochs=2)
    model = LitGPT()
    trainer.fit(model, make_loader(1, 2 * world, world), ckpt_path=valid)
    full, _ = flatshard.get_state_dict(model, rank0_only=False)
    out["valid"] = {"global_step": trainer.global_step, "state": full}
    return out


@pytest.fixture(scope="module")
def bad_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("bad")
    # Another model: vocab 41 instead of 37 and other weights; the blocks and "steps" have the right shapes,
    # so a loader that copied key by key before validating would change them.
    other, _, _ = train_reference(1, 4, seed=1, vocab=41)
    other.save_checkpoint(directory / "other_model.ckpt")
    valid, _, _ = train_reference(1, 4)
    valid.save_checkpoint(directory / "valid.ckpt")
    two_groups = make_trainer(1, "auto", max_epochs=1)
    two_groups.fit(TwoGroupsGPT(seed=1), make_loader(1, 4, 1))
    two_groups.save_checkpoint(directory / "two_groups.ckpt")
    data = (directory / "valid.ckpt").read_bytes()
    (directory / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    paths = {
        "other_model": directory / "other_model.ckpt",
        "truncated": directory / "truncated.ckpt",
        "missing": directory / "no_such.ckpt",
        "optimizer_groups": directory / "two_groups.ckpt",
    }
    ranks = spawn(_bad_resumes, 2, [(k, str(v)) for k, v in paths.items()], str(directory / "valid.ckpt"))
    return {"paths": paths, "ranks": ranks, "valid": load_ckpt(directory / "valid.ckpt")}


def _records(bad_checkpoints: dict[str, Any], name: str) -> list[dict[str, Any]]:
    records = [r[name] for r in bad_checkpoints["ranks"]]
    for record in records:
        assert record["raised"] is not None, f"fit(ckpt_path=<{name}>) did not raise"
        assert record["sharded"] and record["keys_match"]
        assert record["changed"] == [], f"{name}: a failed load changed {record['changed']}"
    return records


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_checkpoint_of_another_model_names_file_key_and_shapes(bad_checkpoints: dict[str, Any]) -> None:
    path = str(bad_checkpoints["paths"]["other_model"])
    for record in _records(bad_checkpoints, "other_model"):
        assert record["is_checkpoint_error"], record
        message = record["message"]
        assert path in message, message
        assert "model.wte.weight" in message and "(41, 13)" in message and "(37, 13)" in message, message


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_truncated_checkpoint_is_a_checkpoint_error_naming_the_file(bad_checkpoints: dict[str, Any]) -> None:
    path = str(bad_checkpoints["paths"]["truncated"])
    for record in _records(bad_checkpoints, "truncated"):
        assert record["is_checkpoint_error"], record
        assert path in record["message"], record["message"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_missing_checkpoint_is_file_not_found(bad_checkpoints: dict[str, Any]) -> None:
    path = str(bad_checkpoints["paths"]["missing"])
    for record in _records(bad_checkpoints, "missing"):
        assert record["raised"] == "FileNotFoundError", record
        assert path in record["message"], record["message"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_optimizer_state_that_does_not_fit_loads_nothing(bad_checkpoints: dict[str, Any]) -> None:
    """Same model, optimizer saved with two param groups, resumed with one: a CheckpointError naming the file
    that says "Nothing was loaded" -- then the model must still hold its own weights, not the checkpoint's."""
    path = str(bad_checkpoints["paths"]["optimizer_groups"])
    records = [r["optimizer_groups"] for r in bad_checkpoints["ranks"]]
    for record in records:
        assert record["is_checkpoint_error"], record
        assert path in record["message"] and "param groups" in record["message"], record["message"]
    for record in records:
        assert record["changed"] == [], (
            f"the optimizer state was refused ({record['message']!r}) but the model was already overwritten "
            f"by the checkpoint: changed {record['changed'][:5]}..."
        )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ranks_resume_correctly_after_the_failures(bad_checkpoints: dict[str, Any]) -> None:
    """The valid checkpoint (1 step of batch 4) resumed on 2 ranks for 1 more step, after the errors above."""
    for record in (r["valid"] for r in bad_checkpoints["ranks"]):
        assert record["global_step"] == 2
        # Trained one step beyond the checkpoint: every parameter moved, the buffer counted the step.
        saved = bad_checkpoints["valid"]["state_dict"]
        assert int(record["state"]["model.steps"]) == int(saved["model.steps"]) + 1 == 2
        moved = [k for k in saved if k != "model.steps" and not torch.allclose(record["state"][k], saved[k])]
        assert len(moved) == len(saved) - 1


@pytest.mark.timeout(300)
def test_checkpoint_error_is_a_value_error(tmp_path: Path) -> None:
    assert issubclass(CheckpointError, ValueError)
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    from flatshard.checkpoint.files import load_checkpoint_file

    with pytest.raises(CheckpointError, match=re.escape(str(empty))):
        load_checkpoint_file(empty)
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nope.ckpt"))):
        load_checkpoint_file(os.fspath(tmp_path / "nope.ckpt"))


@pytest.mark.parametrize("cls", ["FlatShardStrategy", "FlatShardFabricStrategy"])
def test_fsdp_strategy_arguments_are_taken_or_explained(cls: str) -> None:
    """FSDPStrategy configurations move over as they are: the same meaning is accepted, the rest named with what
    to do instead."""
    strategy = getattr(flatshard, cls)
    strategy(use_orig_params=True)  # flatshard's only behaviour
    for layers in (Block, [Block]):  # Lightning's older name for activation_checkpointing_policy
        check = strategy(activation_checkpointing=layers).options.shard_options(torch.device("cpu"))
        assert check.activation_checkpointing_policy(Block()), layers
        assert not check.activation_checkpointing_policy(torch.nn.Linear(2, 2)), layers
    with pytest.raises(TypeError, match="both activation_checkpointing and activation_checkpointing_policy"):
        strategy(activation_checkpointing=Block, activation_checkpointing_policy={Block})
    for kwargs, hint in (
        ({"use_orig_params": False}, "always keeps the original Parameter objects"),
        ({"device_id": 0}, "the device the Trainer or Fabric gives it"),
        ({"ignored_modules": []}, "flatshard.shard(module, ignored_modules="),
    ):
        with pytest.raises(TypeError, match="Lightning's FSDPStrategy takes it") as err:
            strategy(**kwargs)
        assert hint in str(err.value) and "HINT" in str(err.value), err.value


def test_a_full_file_given_as_a_sharded_checkpoint_says_what_it_is(tmp_path: Any) -> None:
    path = tmp_path / "full.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, path)
    with pytest.raises(flatshard.CheckpointError, match="it is a full checkpoint file") as err:
        flatshard.consolidate(path, tmp_path / "out.ckpt")
    assert "interrupted" not in str(err.value) and "OUT.safetensors" in str(err.value), err.value
    assert not (tmp_path / "out.ckpt").exists()
