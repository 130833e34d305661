"""The article's DDP loop as a torchrun script: it runs as it is under torchrun, and under rayapp.

    torchrun --nproc-per-node 2 train.py --epochs 10
    rayapp submit --nodes 2 --script train.py -- --epochs 10

Either launcher sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, so
``dist.init_process_group()`` needs no arguments. Under rayapp, MLFLOW_RUN_ID names the run rayapp
opened for the job, so ``mlflow.log_metric`` below lands in it, next to rayapp's own records;
under plain torchrun the script trains without MLflow.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per epoch")
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.001)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    log = mlflow_logger() if rank == 0 else None

    torch.manual_seed(0)
    teacher = nn.Linear(10, 10).to(device)  # the function to learn: the same on every rank
    torch.manual_seed(1000 + rank)  # each rank its own random batches, as in the article
    model = DDP(nn.Linear(10, 10).to(device), device_ids=[local_rank] if use_cuda else None)
    optimizer = optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()

    for epoch in range(args.epochs):
        started, loss_sum = time.perf_counter(), torch.zeros((), device=device)
        for _ in range(args.steps):
            inputs = torch.randn(args.batch_size, 10, device=device)
            with torch.no_grad():
                target = teacher(inputs)
            optimizer.zero_grad()
            loss = loss_fn(model(inputs), target)
            loss.backward()  # DDP all-reduces the gradients here
            optimizer.step()
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum)  # the mean over ranks, as every rank sees it
        epoch_loss = loss_sum.item() / (args.steps * dist.get_world_size())
        if rank == 0:
            print(
                f"epoch {epoch + 1}/{args.epochs}  loss {epoch_loss:.5f}  "
                f"{time.perf_counter() - started:.2f}s",
                flush=True,
            )
            if log:
                log("loss", epoch_loss, epoch)
    dist.destroy_process_group()


def mlflow_logger():
    """mlflow.log_metric into the run MLFLOW_RUN_ID names, or None without one (plain torchrun)."""
    if not os.environ.get("MLFLOW_RUN_ID"):
        return None
    import mlflow

    return lambda key, value, step: mlflow.log_metric(key, value, step=step)


if __name__ == "__main__":
    main()
