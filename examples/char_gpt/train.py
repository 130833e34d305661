"""This example's own training loop: rayapp calls ``train_loop(ctx)`` on every Ray Train worker.

What rayapp gives the loop through ``ctx`` (rayapp.train.context.TrainContext): the job's
strategy applied to the model (``ctx.prepare``), this rank's shard of a data set
(``ctx.loader``), the epochs still to run after a restart with the model, optimizer and LR
schedule restored (``ctx.epochs``), the step timers and mixed precision (``ctx.compute``,
``ctx.autocast``), and one MLflow run to log into (``ctx.log_epoch``). Everything else is
ordinary PyTorch, in nanoGPT's style: AdamW, linear warm-up then cosine decay, gradient clipping,
and, with ``train.args.patience``, early stopping on the validation loss.
"""

from __future__ import annotations

import math
import time

import torch
from corpus import load
from gpt import CharGPT, GPTConfig
from torch.nn import functional as F


def cosine_with_warmup(step: int, *, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """The learning rate's multiplier at `step`: linear warm-up, then cosine down to `min_ratio`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def next_byte_loss(
    model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


@torch.no_grad()
def validation_loss(ctx, model: torch.nn.Module, loader, max_batches: int) -> float:
    """Mean next-byte loss over this rank's share of the held-out text, averaged over ranks."""
    model.eval()
    total, batches = torch.zeros((), device=ctx.device), 0
    for inputs, targets in loader:
        if batches == max_batches:
            break
        with ctx.autocast():
            total += next_byte_loss(model, inputs.to(ctx.device), targets.to(ctx.device))
        batches += 1
    model.train()
    return ctx.mean(total / max(batches, 1))


def train_loop(ctx) -> None:
    args = ctx.args
    torch.manual_seed(ctx.spec.train.seed)  # the same initial weights on every rank

    # -- set-up: data, model, optimizer, schedule
    train_set, val_set = load(
        max_bytes=int(args["corpus_bytes"]), block_size=int(args["block_size"])
    )
    train_loader = ctx.loader(train_set)
    val_loader = ctx.loader(val_set, shuffle=False)
    config = GPTConfig(
        block_size=int(args["block_size"]),
        n_layer=int(args["n_layer"]),
        n_head=int(args["n_head"]),
        n_embd=int(args["n_embd"]),
        dropout=float(args.get("dropout", 0.0)),
    )
    model = ctx.prepare(CharGPT(config))
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=ctx.spec.train.lr,
        betas=(0.9, 0.95),
        weight_decay=float(args.get("weight_decay", 0.1)),
    )
    steps_per_epoch = len(train_loader) // ctx.spec.train.grad_accum_steps
    total_steps = steps_per_epoch * ctx.spec.train.epochs
    warmup = max(1, int(total_steps * float(args.get("warmup_fraction", 0.05))))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: cosine_with_warmup(step, warmup=warmup, total=total_steps)
    )
    tokens_per_batch = train_loader.batch_size * config.block_size * ctx.world_size
    patience = args.get("patience")  # epochs without a better val_loss before stopping; none: off
    best_val_loss, epochs_without_better = math.inf, 0

    # -- the epoch loop: epochs done before a restart are skipped, the schedule resumes with them
    for _epoch in ctx.epochs(model, optimizer, schedule=schedule):
        loss_sum, steps, started = torch.zeros((), device=ctx.device), 0, time.perf_counter()
        for inputs, targets in ctx.batches(train_loader):
            with ctx.compute():
                with ctx.autocast():
                    loss = next_byte_loss(model, inputs, targets)
                ctx.backward(loss)
                if ctx.step(optimizer):  # clips to train.grad_clip, steps, zeroes the gradients
                    schedule.step()
            loss_sum += loss.detach()
            steps += 1
        train_s = time.perf_counter() - started

        val_loss = validation_loss(ctx, model, val_loader, int(args.get("val_batches", 20)))
        ctx.log_epoch(
            {
                "loss": ctx.mean(loss_sum / max(steps, 1)),
                "val_loss": val_loss,
                "tokens_per_s": steps * tokens_per_batch / train_s,
                "lr": schedule.get_last_lr()[0],
            }
        )

        # -- early stopping: val_loss is averaged over the ranks, so every rank decides alike and
        # breaks at the same epoch; rayapp still logs and checkpoints this last one
        if val_loss < best_val_loss:
            best_val_loss, epochs_without_better = val_loss, 0
        else:
            epochs_without_better += 1
        if patience is not None and epochs_without_better >= int(patience):
            break
