"""A Fabric training loop with flatshard: sharded model, bf16 mixed precision, gradient accumulation without
syncing, global-norm clipping, and a sharded checkpoint that resumes on another number of processes.

    python examples/fabric/train.py                                # 2 processes, 20 steps, saves /tmp/fabric-ckpt
    python examples/fabric/train.py --devices 3 --resume /tmp/fabric-ckpt --steps 30   # continue on 3

The model is the character-level GPT of ``examples/gpt`` with one sharding unit per ``Block``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpt"))

from model import GPT, Block, CharTokenizer, GPTConfig, TextDataset, init_weights, load_corpus

import flatshard


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps in total (counting resumed ones)")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument(
        "--ckpt", default="/tmp/fabric-ckpt", help="sharded checkpoint directory written at the end"
    )
    p.add_argument("--resume", default=None, help="checkpoint (directory or file) to continue from")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    # The model is built on the meta device below; param_init_fn gives each module the GPT's own init as it is
    # materialized (modules' default reset_parameters() would not: an N(0, 1) embedding, for one).
    strategy = flatshard.FlatShardFabricStrategy(
        auto_wrap_policy={Block}, state_dict_type="sharded", param_init_fn=init_weights
    )
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy, precision=args.precision)
    fabric.launch()
    fabric.seed_everything(0)

    text = load_corpus()
    tokenizer = CharTokenizer(text)
    data = TextDataset(tokenizer.encode_tensor(text), block_size=32, max_samples=4096)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=args.batch_size, shuffle=True))

    with fabric.init_module(empty_init=True):  # built on the meta device, materialized unit by unit
        model = GPT(GPTConfig(tokenizer.vocab_size, block_size=32, n_layer=2, n_head=2, d_model=64))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)  # any number of processes; a directory or a file
        fabric.print(f"resumed at step {state['step']} on {fabric.world_size} processes")

    batches = iter(loader)
    while state["step"] < args.steps:
        for micro in range(args.accumulate):
            try:
                x, y = next(batches)
            except StopIteration:
                batches = iter(loader)
                x, y = next(batches)
            last = micro == args.accumulate - 1
            with fabric.no_backward_sync(model, enabled=not last):  # reduce once per optimizer step
                loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
                fabric.backward(loss / args.accumulate)
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        if state["step"] % 5 == 0 or state["step"] == args.steps:
            fabric.print(f"step {state['step']}: loss {loss.item():.4f}, grad norm {float(norm):.3f}")
    fabric.save(args.ckpt, state)
    fabric.print(f"saved a sharded checkpoint to {args.ckpt}")


if __name__ == "__main__":
    main()
