"""Shared pieces of the Lightning tier: a LightningModule around TinyGPT, deterministic data, a Trainer factory.

Data layout (why the global batches match): the dataset is the concatenation of ``make_batch(step, G)`` for
``step = 0, 1, ...``. For training on ``W > 1`` ranks Lightning 2.6 injects a ``DistributedSampler`` and forces
``shuffle=True`` for it whatever the DataLoader says (``data_connector._process_dataloader`` sets
``is_shuffled = True`` for the training stage), with ``seed = PL_GLOBAL_SEED or 0`` and ``set_epoch(epoch)``
every epoch. Such a sampler draws ``perm = randperm(N)`` from a generator seeded with ``seed + epoch`` (the same
permutation for every ``W``) and gives rank ``r`` the indices ``perm[r::W]``; with per-rank batch ``B = G / W``
rank ``r``'s ``k``-th batch is ``{perm[r + W*(k*B + j)] : j < B}``, and the union over ranks of the ``k``-th
batches is exactly ``perm[k*G : (k+1)*G]``. So the 1-device reference uses the same sampler with
``num_replicas=1`` (Lightning calls its ``set_epoch`` too) and batch ``G``: every global step sees the same set of
samples on any world size. Every rank has ``B`` samples of the same length, so the mean over ranks of the
per-rank mean losses (what DDP / flatshard average) is the global batch's mean loss. No padding is added: the
dataset length is a multiple of ``W`` (checked in ``make_loader``).

Functions that run inside ``flatshard.testing.spawn`` live in the test modules (module level, picklable);
the spawned processes import them as ``tests.lightning.<module>`` (they inherit pytest's ``sys.path``, which holds
the repository root).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from flatshard.testing.models import TinyGPT, make_batch

MODEL_PREFIX = "model."  # LitGPT keeps TinyGPT as ``self.model``: checkpoint keys are "model.<name>"
WEIGHT_TOL = {"atol": 1e-5, "rtol": 1e-5}

# Lightning's advice about DataLoader workers and similar noise is irrelevant for these tiny runs.
warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*LeafSpec.*")
warnings.filterwarnings("ignore", message=".*sync_dist=True.*")


class LitGPT(L.LightningModule):
    """TinyGPT trained on next-token loss. Weights are seeded here, so every rank and reference agree."""

    def __init__(
        self,
        seed: int = 0,
        lr: float = 1e-2,
        optimizer: str = "adamw",
        vocab: int = 37,
        d_model: int = 13,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = TinyGPT(vocab=vocab, d_model=d_model)
        self.lr = lr
        self.optimizer_name = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, target = batch[0], batch[1]
        loss = self.model.loss(idx, target)
        self.model.steps += 1  # a buffer that changes with training: checkpoints must carry it
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.optimizer_name == "adagrad":  # creates its state in the constructor
            return torch.optim.Adagrad(self.parameters(), lr=self.lr, initial_accumulator_value=0.1)
        if self.optimizer_name == "groups":
            return shape_grouped_adamw(self, self.lr)
        raise ValueError(self.optimizer_name)


def shape_grouped_adamw(module: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """Param groups as GPT recipes write them: weight decay only on matrices (chosen by ``p.ndim``), and the
    embeddings (the token one tied to the head) at their own learning rate. With block units, the first two
    groups span every unit and the root."""
    named = list(module.named_parameters())
    embeddings = [p for n, p in named if n.startswith(("model.wte", "model.wpe"))]
    rest = [p for n, p in named if not n.startswith(("model.wte", "model.wpe"))]
    return torch.optim.AdamW(
        [
            {"params": [p for p in rest if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0},
            {"params": embeddings, "lr": lr / 2, "weight_decay": 0.05},
        ],
        lr=lr,
    )


class LossRecorder(Callback):
    """The synced ``train_loss`` Lightning holds after each training batch (what a logger would receive)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def make_dataset(steps: int, global_batch: int, first_step: int = 0) -> TensorDataset:
    """``steps`` global batches of ``global_batch`` samples, step ``k``'s samples at ``[k*G, (k+1)*G)``."""
    batches = [make_batch(s, global_batch) for s in range(first_step, first_step + steps)]
    return TensorDataset(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))


def make_loader(steps: int, global_batch: int, world: int) -> DataLoader:
    """Per-rank loader for ``world`` ranks; for ``world == 1`` the reference loader described above."""
    assert global_batch % world == 0, (global_batch, world)
    dataset = make_dataset(steps, global_batch)
    assert len(dataset) % world == 0  # no DistributedSampler padding
    if world > 1:  # Lightning adds its (shuffling) DistributedSampler
        return DataLoader(dataset, batch_size=global_batch // world, shuffle=False)
    sampler = DistributedSampler(
        dataset, num_replicas=1, rank=0, shuffle=True, seed=int(os.getenv("PL_GLOBAL_SEED", "0"))
    )
    return DataLoader(dataset, batch_size=global_batch, sampler=sampler)


def strategy_by_name(name: str) -> Any:
    """The strategy argument for a short test name (``flatshard_block`` wraps each ``Block``)."""
    import flatshard
    from flatshard.testing.models import Block

    return {
        "ddp": "ddp",
        "flatshard": "flatshard",
        "flatshard_block": flatshard.FlatShardStrategy(auto_wrap_policy={Block}),
        "flatshard_grad_op": "flatshard_grad_op",
    }[name]


def make_trainer(devices: int, strategy: Any, **kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": devices,
        "strategy": strategy,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
    }
    options.update(kwargs)
    return L.Trainer(**options)


def strip_prefix(state_dict: dict[str, Any], prefix: str = MODEL_PREFIX) -> dict[str, Any]:
    assert all(k.startswith(prefix) for k in state_dict), sorted(state_dict)
    return {k[len(prefix) :]: v for k, v in state_dict.items()}


def load_ckpt(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A checkpoint read with plain torch (no flatshard code involved)."""
    return torch.load(path, map_location="cpu", weights_only=False)


def assert_same_weights(actual: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    assert sorted(actual) == sorted(expected), f"{what}: keys differ: {sorted(actual)} vs {sorted(expected)}"
    for key in expected:
        torch.testing.assert_close(
            actual[key], expected[key], **WEIGHT_TOL, msg=lambda m, key=key: f"{what}: {key}: {m}"
        )


def assert_same_optimizer_state(actual: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    """Plain optimizer state dicts agree: same param_groups (ints and hyper-parameters), same state tensors."""
    assert actual["param_groups"] == expected["param_groups"], f"{what}: param_groups differ"
    assert sorted(actual["state"]) == sorted(expected["state"]), f"{what}: state indices differ"
    for idx, entries in expected["state"].items():
        assert sorted(actual["state"][idx]) == sorted(entries), f"{what}: state keys of #{idx} differ"
        for key, value in entries.items():
            got = actual["state"][idx][key]
            if isinstance(value, torch.Tensor):
                assert isinstance(got, torch.Tensor) and got.dtype == value.dtype, (what, idx, key)
                torch.testing.assert_close(
                    got, value, **WEIGHT_TOL, msg=lambda m, idx=idx, key=key: f"{what}: #{idx} {key}: {m}"
                )
            else:
                assert got == value, (what, idx, key, got, value)


def assert_runs_close(runs: dict[str, Any], ours: str, theirs: str, steps: int, tol: float) -> None:
    """Two recorded runs (``runs["ranks"][0][name]["losses"]``, ``runs["ckpt"][name]``) agree to ``tol``:
    losses step by step, and every checkpoint entry in dtype, and in value (floats within ``tol``)."""
    mine, peer = runs["ranks"][0][ours], runs["ranks"][0][theirs]
    assert len(mine["losses"]) == len(peer["losses"]) == steps
    for a, b in zip(mine["losses"], peer["losses"]):
        assert abs(a - b) <= tol * max(1.0, abs(b)), (ours, mine["losses"], peer["losses"])
    state = strip_prefix(runs["ckpt"][ours]["state_dict"])
    for key, value in strip_prefix(runs["ckpt"][theirs]["state_dict"]).items():
        assert state[key].dtype == value.dtype, (key, state[key].dtype, value.dtype)
        if value.is_floating_point():
            torch.testing.assert_close(state[key].float(), value.float(), atol=tol, rtol=tol, msg=key)
        else:
            assert torch.equal(state[key], value), key


def fit_and_save(
    world: int,
    strategy: Any,
    model: L.LightningModule,
    loader: DataLoader,
    epochs: int,
    out: str | os.PathLike[str],
    ckpt_path: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Fit ``model`` to ``epochs`` epochs (resuming from ``ckpt_path`` if given) and save the result to
    ``out``; return the global step and the losses recorded on this rank."""
    recorder = LossRecorder()
    trainer = make_trainer(world, strategy, max_epochs=epochs, callbacks=[recorder])
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    trainer.save_checkpoint(out)
    return {"global_step": trainer.global_step, "losses": recorder.losses}


def train_reference(
    steps_per_epoch: int, global_batch: int, epochs: int = 1, **lit_kwargs: Any
) -> tuple[L.Trainer, LitGPT, LossRecorder]:
    """One device, ``strategy="auto"``, the whole global batch per step (run in the pytest process)."""
    model = LitGPT(**lit_kwargs)
    recorder = LossRecorder()
    trainer = make_trainer(1, "auto", max_epochs=epochs, callbacks=[recorder])
    trainer.fit(model, make_loader(steps_per_epoch, global_batch, 1))
    return trainer, model, recorder
