"""Train a small character-level GPT on Shakespeare with PyTorch Lightning and the flatshard strategy.

Default run (CPU, 2 processes, about two minutes on 2 cores)::

    python examples/gpt/train.py

Plain DDP for comparison::

    python examples/gpt/train.py --strategy ddp

At the end rank 0 prints a sample from the trained model (temperature 0.8, top-k 10, seeded), the validation
loss beside a uniform guess's and the throughput; every rank prints one line with its loss and the bytes of
parameters, gradients and optimizer state it holds, beside what one unsharded process holds.
"""

from __future__ import annotations

import argparse
import math
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import TQDMProgressBar
from torch import Tensor
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))  # make ``model`` importable from anywhere

from model import GPT, Block, CharTokenizer, GPTConfig, TextDataset, generate, load_corpus

try:  # registers ``Trainer(strategy="flatshard")``
    import flatshard
except Exception as err:  # the package may be missing or unfinished: ``--strategy ddp`` still works
    flatshard = None
    _FLATSHARD_IMPORT_ERROR: BaseException | None = err
else:
    _FLATSHARD_IMPORT_ERROR = None

SAMPLE_PROMPT = "MACBETH:\n"
SAMPLE_TOKENS = 300
SAMPLE_TEMPERATURE = 0.8
SAMPLE_TOP_K = 10
VAL_FRACTION = 0.1
VAL_SAMPLES = 512
WARMUP_STEPS = 10


class GPTLitModule(L.LightningModule):
    """Wraps :class:`model.GPT`; the GPT itself is built in :meth:`configure_model`."""

    def __init__(
        self,
        vocab: str,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        d_model: int = 64,
        lr: float = 1e-2,
        weight_decay: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()  # the vocabulary travels in the checkpoint too
        self.tokenizer = CharTokenizer(vocab)
        self.config = GPTConfig(
            vocab_size=self.tokenizer.vocab_size,
            block_size=block_size,
            n_layer=n_layer,
            n_head=n_head,
            d_model=d_model,
        )
        self.model: GPT | None = None
        self.sample_ids: list[int] | None = None  # filled on every rank by ``on_train_end``
        self.last_train_loss: Tensor | None = None  # this rank's loss at its last training step
        self.sample_seed = 0  # set by main(): the same sample on every rank
        self.fit_started: float | None = None
        self.fit_steps = 0  # optimizer steps this run (a resumed run counts its own)
        self.tokens_per_step = 0
        self.full_numel = 0
        self.held: dict[str, int] = {}  # bytes this rank held at its last optimizer step

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = GPT(self.config)
        self.full_numel = sum(p.numel() for p in self.model.parameters())  # before sharding: whole

    def forward(self, idx: Tensor) -> Tensor:
        assert self.model is not None, "configure_model() has not run"
        return self.model(idx)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    def on_train_start(self) -> None:
        self.fit_started = time.perf_counter()
        self.fit_steps = -self.trainer.global_step

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.trainer.global_step + 1 >= self.trainer.max_steps:  # the last step: gradients are all there
            self.held = self.held_bytes()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.tokens_per_step = batch[0].numel() * self.trainer.world_size
        loss = self._loss(batch)
        self.last_train_loss = loss.detach()
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> dict[str, Any]:
        # Two parameter groups chosen by parameter NAME: no weight decay for biases, LayerNorms and
        # the embeddings (the tied LM head is the token embedding, so it is listed once, as wte).
        decay, no_decay = [], []
        for name, param in self.named_parameters():
            if not param.requires_grad:
                continue
            (no_decay if _no_weight_decay(name) else decay).append(param)
        groups = [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=self.hparams.lr, betas=(0.9, 0.95)
        )
        # linear warm-up over the first WARMUP_STEPS steps, then a constant learning rate
        warmup = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / WARMUP_STEPS)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    def on_train_end(self) -> None:
        # Runs on every rank before the strategy tears down: with a sharded strategy the forward hooks
        # gather parameters collectively, so all ranks must run the same forwards.
        self.fit_steps += self.trainer.global_step
        seconds = time.perf_counter() - (self.fit_started or time.perf_counter())
        was_training = self.training
        self.eval()
        prompt = self.tokenizer.encode_tensor(SAMPLE_PROMPT)[None].to(self.device)
        sampler = torch.Generator().manual_seed(self.sample_seed)
        out = generate(
            self, prompt, SAMPLE_TOKENS, self.config.block_size, SAMPLE_TEMPERATURE, SAMPLE_TOP_K, sampler
        )
        self.sample_ids = out[0].tolist()
        self.train(was_training)
        self.report(seconds)

    def held_bytes(self) -> dict[str, int]:
        """Bytes of the distinct storages behind this rank's parameters, gradients and optimizer state (a
        storage shared by several tensors counted once)."""

        def storages(tensors: list[Tensor]) -> int:
            seen: dict[int, int] = {}
            for t in tensors:
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
            return sum(seen.values())

        params = list(self.parameters())
        state = [
            v
            for opt in self.trainer.optimizers
            for st in opt.state.values()
            for v in st.values()
            if isinstance(v, Tensor) and v.dim() > 0
        ]
        return {
            "params": storages(params),
            "grads": storages([p.grad for p in params if p.grad is not None]),
            "optim": storages(state),
        }

    def unsharded_bytes(self) -> dict[str, int]:
        """What one process holds with the whole model: parameters, gradients and AdamW's two moments, fp32."""
        n = (
            self.full_numel
        )  # counted when the model was built, before sharding (the tied head is one parameter)
        return {"params": 4 * n, "grads": 4 * n, "optim": 8 * n}

    def report(self, seconds: float) -> None:
        """Rank 0 prints the sample and the run's summary; then each rank prints one line, in rank order."""
        rank, world = self.global_rank, self.trainer.world_size
        val = self.trainer.callback_metrics.get("val_loss")
        val_loss = float(val) if val is not None else math.nan
        peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        held, whole = self.held or self.held_bytes(), self.unsharded_bytes()
        train_loss = float(self.last_train_loss) if self.last_train_loss is not None else math.nan
        mib = 2**20
        line = (
            f"[rank {rank}/{world}] train_loss={train_loss:.4f} val_loss={val_loss:.4f} "
            f"param_bytes={held['params']} param_mib={held['params'] / mib:.2f} "
            f"grad_mib={held['grads'] / mib:.2f} optim_mib={held['optim'] / mib:.2f} peak_rss_mib={peak_rss_mib:.1f}"
        )
        if rank == 0:
            if self.sample_ids is not None:
                print(
                    f"--- sample ({SAMPLE_TOKENS} characters, temperature {SAMPLE_TEMPERATURE}, top-k "
                    f"{SAMPLE_TOP_K}, seed {self.sample_seed}) ---",
                    flush=True,
                )
                print(self.tokenizer.decode(self.sample_ids), flush=True)
                print("--- end of sample ---", flush=True)
            uniform = math.log(self.tokenizer.vocab_size)
            print(
                f"val_loss {val_loss:.3f} nats/character; a uniform guess over the {self.tokenizer.vocab_size} "
                f"characters scores {uniform:.3f}",
                flush=True,
            )
            if self.fit_steps > 0 and seconds > 0:
                print(
                    f"{self.fit_steps} steps in {seconds:.0f} s on {world} processes: "
                    f"{self.fit_steps * self.tokens_per_step / seconds:,.0f} characters/s "
                    f"({self.tokens_per_step} per step)",
                    flush=True,
                )
            print(
                f"one unsharded process would hold param_mib={whole['params'] / mib:.2f} "
                f"grad_mib={whole['grads'] / mib:.2f} optim_mib={whole['optim'] / mib:.2f}; each rank holds:",
                flush=True,
            )
        if world > 1:
            self.trainer.strategy.barrier("gpt_example_report")
        for r in range(world):
            if r == rank:
                print(line, flush=True)
            if world > 1:
                self.trainer.strategy.barrier("gpt_example_report")


def _no_weight_decay(name: str) -> bool:
    """Biases, LayerNorm weights and the embeddings (incl. the tied head) get no weight decay."""
    parts = name.lower().split(".")
    return (
        "bias" in name
        or any(p.startswith("ln") or "norm" in p for p in parts)
        or any(p in ("wte", "wpe") for p in parts)
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a small character-level GPT on Shakespeare (CPU, multi-process).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--strategy", default="flatshard", help="Lightning strategy name, e.g. flatshard or ddp")
    p.add_argument("--devices", type=int, default=2, help="number of CPU processes")
    p.add_argument("--max-steps", type=int, default=1000, help="optimizer steps to train for (in total)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per process per step")
    p.add_argument("--d-model", type=int, default=64, help="embedding width")
    p.add_argument("--n-layer", type=int, default=4, help="number of transformer blocks")
    p.add_argument("--n-head", type=int, default=4, help="attention heads per block")
    p.add_argument("--block-size", type=int, default=64, help="context length in characters")
    p.add_argument("--lr", type=float, default=1e-2, help="peak AdamW learning rate (after warm-up)")
    p.add_argument("--seed", type=int, default=1234, help="seed for init, data order and dropout")
    p.add_argument(
        "--ckpt-out", default=None, help="save a checkpoint here at the end (trainer.save_checkpoint)"
    )
    p.add_argument(
        "--resume", default=None, help="checkpoint file or sharded directory to resume from (fit's ckpt_path)"
    )
    p.add_argument(
        "--state-dict-type",
        choices=["full", "sharded"],
        default="full",
        help="flatshard only: what --ckpt-out writes, one consolidated file or a directory every rank writes",
    )
    p.add_argument(
        "--wrap",
        choices=["block", "none"],
        default="block",
        help="flatshard only: 'block' shards each transformer Block as its own unit "
        "(FlatShardStrategy(auto_wrap_policy={Block})), 'none' uses the plain strategy name",
    )
    return p.parse_args(argv)


def make_strategy(args: argparse.Namespace) -> Any:
    if not args.strategy.startswith("flatshard"):
        return args.strategy
    if flatshard is None:
        raise ImportError(
            f"--strategy {args.strategy} needs the flatshard package"
        ) from _FLATSHARD_IMPORT_ERROR
    if args.strategy == "flatshard":
        policy = {Block} if args.wrap == "block" else None
        return flatshard.FlatShardStrategy(auto_wrap_policy=policy, state_dict_type=args.state_dict_type)
    if args.state_dict_type != "full":
        raise ValueError(f"--state-dict-type {args.state_dict_type} needs --strategy flatshard")
    return args.strategy


class StepProgressBar(TQDMProgressBar):
    """Counts optimizer steps toward ``max_steps`` across epochs and resumes ("Steps 1000/1000"), not batches
    of an epoch the run never finishes (the training set holds more batches than the run takes)."""

    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        bar = self.train_progress_bar  # made in on_train_start; kept across epochs
        bar.set_description("Steps", refresh=False)
        bar.reset(total=trainer.max_steps)
        bar.n = bar.initial = trainer.global_step
        bar.refresh()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        bar, step = self.train_progress_bar, trainer.global_step
        if not bar.disable and (step % self.refresh_rate == 0 or step == trainer.max_steps):
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")
    L.seed_everything(args.seed, verbose=False)

    text = load_corpus()
    tokenizer = CharTokenizer(text)
    data = tokenizer.encode_tensor(text)
    n_val = int(len(data) * VAL_FRACTION)
    train_set = TextDataset(data[:-n_val], args.block_size)
    val_set = TextDataset(data[-n_val:], args.block_size, max_samples=VAL_SAMPLES)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, shuffle=False)

    module = GPTLitModule(
        vocab="".join(tokenizer.chars),
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        d_model=args.d_model,
        lr=args.lr,
    )
    module.sample_seed = args.seed
    steps_per_epoch = max(1, len(train_set) // (args.batch_size * args.devices))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=make_strategy(args),
        max_steps=args.max_steps,
        # max_steps ends the run; the progress bar counts steps toward it. A finite max_epochs, one more than
        # needed, as a run stopped by max_steps mid-epoch resumes at the next epoch.
        max_epochs=math.ceil(args.max_steps / steps_per_epoch) + 1,
        # validate once, after the last step (counted across epochs and resumes)
        val_check_interval=args.max_steps,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        log_every_n_steps=10,
        callbacks=[StepProgressBar()],
    )
    trainer.fit(module, train_loader, val_loader, ckpt_path=args.resume)
    if args.ckpt_out:
        trainer.save_checkpoint(args.ckpt_out, weights_only=False)  # collective: every rank calls it
        if trainer.is_global_zero:
            print(f"saved checkpoint to {args.ckpt_out}", flush=True)


if __name__ == "__main__":
    main()
