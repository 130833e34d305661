"""The baseline for `python -m benchmarks.overhead`: a plain DDP loop, launched by torchrun.

It trains exactly what `rayapp submit` trains for the same job and world size (same spec,
data set, model, loss, optimizer, sampler and batches), built with the same builders rayapp's
built-in loop calls (rayapp.train.data, rayapp.train.models), with none of rayapp's extras:
no Ray, no MLflow, no checkpoints, no comm timing. Each epoch is timed the
way rayapp times it (perf_counter around the step loop, the slowest rank's figure), and
rank 0 writes the per-epoch times to a JSON file.

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29500 \\
        benchmarks/torchrun_ddp.py --job jobs/mlp_synthetic.yaml --epochs 6 --out /tmp/torchrun.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rayapp.spec.loader import load_spec
from rayapp.train.collectives import max_over_ranks, mean_over_ranks
from rayapp.train.data import build_datasets, build_loader, shard_sampler
from rayapp.train.models import build_loss, build_model, build_optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="rayapp job YAML")
    parser.add_argument("--epochs", type=int, default=None, help="override train.epochs")
    parser.add_argument(
        "--out", required=True, help="JSON file rank 0 writes the per-epoch times to"
    )
    parser.add_argument(
        "--comm-clock",
        choices=("none", "rayapp"),
        default="none",
        help=(
            "also read rayapp's per-step comm clock (rayapp.train.timing.DdpCommClock), "
            "to measure what it costs"
        ),
    )
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # One worker per "node", as `rayapp submit --nodes N --workers-per-node 1` runs it.
    spec = load_spec(
        args.job,
        {"cluster.nodes": world_size, "cluster.workers_per_node": 1, "train.epochs": args.epochs},
    )

    # As rayapp.train.loop.standard_loop builds them (through TrainContext.loader on a CPU worker):
    # the rank's shard (DistributedSampler, seed train.seed, drop_last) in the per-worker batch
    # size.
    datasets = build_datasets(spec)
    loader = build_loader(
        spec, datasets.train, rank=rank, world_size=world_size, shuffle=True, pin_memory=False
    )
    sampler = shard_sampler(loader)
    model = DistributedDataParallel(build_model(spec))  # what rayapp's ddp strategy does on CPU
    comm_clock = None
    if args.comm_clock == "rayapp":
        from rayapp.train.timing import DdpCommClock

        comm_clock = DdpCommClock(model)
    optimizer = build_optimizer(spec, model)
    loss_fn = build_loss(spec)

    threads: list = [None] * world_size
    dist.all_gather_object(
        threads,
        {
            "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        },
    )

    cpu = torch.device("cpu")
    epoch_times, losses, epoch_ends, epoch_ends_unix = [], [], [], []
    for epoch in range(spec.train.epochs):
        sampler.set_epoch(epoch)
        loss_sum = torch.zeros(())
        started = time.perf_counter()
        for inputs, targets in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
            if comm_clock is not None:
                comm_clock.step_finished()
            loss_sum += loss.detach()
        elapsed = time.perf_counter() - started

        # Reduced as rayapp's loop reduces them (the slowest rank's time; the loss averaged over
        # ranks in float64), so that the losses of the two sides compare bit for bit.
        epoch_times.append(max_over_ranks([elapsed], cpu)[0])
        losses.append(mean_over_ranks(loss_sum / spec.steps_per_epoch, cpu))
        epoch_ends.append(time.perf_counter())
        epoch_ends_unix.append(time.time())

    if rank == 0:
        result = {
            "job": spec.name,
            "world_size": world_size,
            "backend": dist.get_backend(),
            "comm_clock": args.comm_clock,
            "epochs": spec.train.epochs,
            "steps_per_epoch": spec.steps_per_epoch,
            "batch_size_per_worker": spec.batch_size_per_worker,
            "epoch_time_s": epoch_times,
            "loss": losses,
            "epoch_end_s": epoch_ends,
            "epoch_end_unix": epoch_ends_unix,
            "threads_per_rank": threads,
            "torch_version": torch.__version__,
        }
        out = Path(args.out)
        partial = out.with_suffix(out.suffix + ".partial")
        partial.write_text(json.dumps(result, indent=2))
        partial.replace(out)
    # Rank 1 otherwise reaches teardown while rank 0 still writes, and Gloo can abort at exit
    # ("terminate called without an active exception") on a pair rank 0 has not closed yet.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
