"""What one checkpoint costs: time and bytes, DDP and FSDP, full state dict vs DCP shards.

Two ranks (Gloo on CPUs, NCCL on GPUs) train one step of a large MLP with Adam, so the optimizer
holds its two moments, then save it `--repeats` times with rayapp's own checkpoint code
(`rayapp.train.checkpoint.save`, as every epoch's checkpoint does) in each combination:

- ``full``: every rank gathers the whole model and optimizer state to CPU; rank 0 writes one file.
- ``dcp``: torch.distributed.checkpoint; each rank writes what it holds (its FSDP shard; DDP's
  replicated tensors once).

It prints the median save time (the slowest rank's), the bytes written, the peak extra memory
the save took on rank 0, and each time as a ratio to ``ddp/full`` measured in the same run. Ray
Train then copies the same files to storage; that copy scales with the bytes and is not timed here.

Then the training pause per save, sync against async (``checkpoint.async``: DCP's ``async_save``),
for DDP and FSDP with DCP: `--pairs` pairs of one sync save and one async save in the same
processes, alternating which goes first. The pause is how long the save call held the training loop
(the slowest rank's): all of a sync save; the staging copy of an async one, whose write then runs
in the background while the ranks take training steps. It prints the median pause with its range,
the median of each pair's async/sync ratio, and how long the background write took.

    python benchmarks/checkpoint.py                      # 50M parameters, 3 saves each, 5 pairs
    python benchmarks/checkpoint.py --width 4096 --layers 3 --repeats 5 --dir /mnt/nvme/tmp
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from rayapp.launch.cluster import free_port
from rayapp.spec.loader import build_spec
from rayapp.train.checkpoint import BackgroundWrite, load, save
from rayapp.train.strategies import apply_strategy

WORLD_SIZE = 2
COMBINATIONS = (("ddp", "full"), ("ddp", "dcp"), ("fsdp", "full"), ("fsdp", "dcp"))


def build_mlp(width: int, layers: int) -> nn.Module:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks[:-1])


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one_rank(
    rank: int, args: argparse.Namespace, port: int, strategy: str, fmt: str, results: dict
) -> None:
    """One combination in fresh processes, so rank 0's peak memory is this combination's own."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=WORLD_SIZE)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    try:
        spec = build_spec(
            {
                "name": "checkpoint_bench",
                "train": {"strategy": strategy},
                "checkpoint": {"format": fmt},
                "cluster": {"nodes": WORLD_SIZE},
            }
        )
        mlp = build_mlp(args.width, args.layers)
        parameters = sum(p.numel() for p in mlp.parameters())
        model = apply_strategy(spec, mlp, device).model
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        model(torch.randn(8, args.width, device=device)).square().mean().backward()
        optimizer.step()  # Adam's moments exist: the state a real checkpoint carries
        times, sizes = [], []
        rss_before = rss_mb()
        for repeat in range(args.repeats):
            directory = os.path.join(args.dir, f"{strategy}-{fmt}-{repeat}")
            if rank == 0:
                os.makedirs(directory)
            dist.barrier()
            started = time.perf_counter()
            save(spec, directory, model, optimizer, {}, rank=rank)
            elapsed = torch.tensor([time.perf_counter() - started])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(elapsed.item())
            dist.barrier()
            if rank == 0:
                sizes.append(
                    sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())
                )
            if (
                repeat == args.repeats - 1
            ):  # it also loads back: the resume path works on this state
                started = time.perf_counter()
                load(directory, model, optimizer, {})
                load_s = time.perf_counter() - started
            dist.barrier()
            if rank == 0:
                shutil.rmtree(directory)
        if rank == 0:
            results[(strategy, fmt)] = {
                "save_s": statistics.median(times),
                "bytes": statistics.median(sizes),
                "load_s": load_s,
                "rss_growth_mb": rss_mb() - rss_before,
                "parameters": parameters,
            }
    finally:
        dist.destroy_process_group()


def slowest(seconds: float) -> float:
    """The slowest rank's figure (a collective)."""
    value = torch.tensor([seconds])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def pause_pairs(
    rank: int, args: argparse.Namespace, port: int, strategy: str, results: dict
) -> None:
    """`--pairs` pairs of a sync and an async DCP save of the same state, in one process group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=rank, world_size=2)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    try:
        specs = {
            mode: build_spec(
                {
                    "name": "checkpoint_bench",
                    "train": {"strategy": strategy},
                    "checkpoint": {"format": "dcp", "async": mode == "async"},
                    "cluster": {"nodes": WORLD_SIZE},
                }
            )
            for mode in ("sync", "async")
        }
        model = apply_strategy(specs["sync"], build_mlp(args.width, args.layers), device).model
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        batch = torch.randn(8, args.width, device=device)

        def train_step() -> None:
            model(batch).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        train_step()
        background = BackgroundWrite()
        pauses: dict[str, list[float]] = {"sync": [], "async": []}
        writes, steps_during = [], []
        for pair in range(args.pairs):
            order = ("sync", "async") if pair % 2 == 0 else ("async", "sync")
            for mode in order:
                directory = os.path.join(args.dir, f"pause-{strategy}-{pair}-{mode}")
                if rank == 0:
                    os.makedirs(directory)
                dist.barrier()
                started = time.perf_counter()
                written = save(
                    specs[mode],
                    directory,
                    model,
                    optimizer,
                    {},
                    rank=rank,
                    background=background if mode == "async" else None,
                )
                pause = time.perf_counter() - started
                steps = 0
                if written is not None:  # train while the write runs, as the loop would
                    while not written.done() and steps < 50:
                        train_step()
                        steps += 1
                    background.wait()
                    writes.append(slowest(time.perf_counter() - started))
                    steps_during.append(steps)
                pauses[mode].append(slowest(pause))
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(directory)
        if rank == 0:
            results[strategy] = {"pauses": pauses, "writes": writes, "steps": steps_during}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096, help="features per layer (default 4096)")
    parser.add_argument(
        "--layers", type=int, default=3, help="linear layers (default 3: 50M parameters)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="saves per combination; the median is shown"
    )
    parser.add_argument(
        "--pairs", type=int, default=5, help="sync/async pairs per strategy (pause comparison)"
    )
    parser.add_argument(
        "--dir", default=tempfile.gettempdir(), help="where checkpoints are written"
    )
    args = parser.parse_args()
    args.dir = tempfile.mkdtemp(prefix="rayapp-ckpt-bench-", dir=args.dir)
    try:
        with mp.Manager() as manager:
            results = manager.dict()
            for strategy, fmt in COMBINATIONS:
                mp.spawn(
                    one_rank,
                    args=(args, free_port(), strategy, fmt, results),
                    nprocs=WORLD_SIZE,
                    join=True,
                )
            results = dict(results)
            pauses = manager.dict()
            for strategy in ("ddp", "fsdp"):
                mp.spawn(
                    pause_pairs,
                    args=(args, free_port(), strategy, pauses),
                    nprocs=WORLD_SIZE,
                    join=True,
                )
            pauses = dict(pauses)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    report(results, args)
    report_pauses(pauses, args)


def report(results: dict, args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    parameters = next(iter(results.values()))["parameters"]
    device = (
        torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else f"CPU ({os.cpu_count()} cores)"
    )
    table = Table(
        title=(
            f"One checkpoint of a {parameters / 1e6:.0f}M-parameter MLP with Adam, "
            f"{WORLD_SIZE} ranks, {device}, {datetime.date.today()}, {platform.node()}"
        )
    )
    for column in (
        "strategy",
        "format",
        "save (median)",
        "vs ddp/full",
        "written",
        "load",
        "rank 0 peak memory growth (save, load)",
    ):
        table.add_column(column, justify="left" if column in ("strategy", "format") else "right")
    baseline = results[("ddp", "full")]["save_s"]
    for (strategy, fmt), figures in results.items():
        table.add_row(
            strategy,
            fmt,
            f"{figures['save_s']:.2f} s",
            f"{figures['save_s'] / baseline:.2f}x",
            f"{figures['bytes'] / 2**20:,.0f} MiB",
            f"{figures['load_s']:.2f} s",
            f"{figures['rss_growth_mb']:,.0f} MiB",
        )
    Console(width=160).print(table)
    print(
        f"command: python benchmarks/checkpoint.py --width {args.width} --layers {args.layers} "
        f"--repeats {args.repeats} --pairs {args.pairs}"
    )


def median_range(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} s ({min(values):.3f}-{max(values):.3f})"


def report_pauses(pauses: dict, args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=(
            f"Training pause per DCP save, sync vs async, {args.pairs} pairs, median (range); "
            "ratios against the sync save of the same pair"
        )
    )
    for column in ("strategy", "sync pause", "async pause", "async/sync", "async write (bg)"):
        table.add_column(column, justify="left" if column == "strategy" else "right")
    for strategy, figures in pauses.items():
        sync, asynchronous = figures["pauses"]["sync"], figures["pauses"]["async"]
        ratios = [a / s for a, s in zip(asynchronous, sync, strict=True)]
        table.add_row(
            strategy,
            median_range(sync),
            median_range(asynchronous),
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
            f"{median_range(figures['writes'])}, {statistics.median(figures['steps']):.0f} steps",
        )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
