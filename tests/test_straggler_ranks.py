"""A rank's own step time names the straggler even though DDP makes whole steps take equally
long on every rank: two real processes on a Gloo group, rank 1 slow to get its batches (a sleep
where its loader would be), rank 0 then waiting for it in the gradient all-reduce."""

from __future__ import annotations

import multiprocessing
import socket
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rayapp.tracking.logger import NullLogger
from rayapp.train.efficiency import EpochEfficiency
from rayapp.train.timing import DeviceTimer

SLOW_S = 0.2
STEPS = 6


def _rank(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        cpu = torch.device("cpu")
        model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 4)))
        timer = DeviceTimer(cpu, read_every=2)
        efficiency = EpochEfficiency(device=cpu, precision="fp32", logger=NullLogger())
        efficiency.watch(model.module, model, timer.mark_ready)
        whole_steps = []
        for _ in range(STEPS):
            started = time.perf_counter()
            timer.mark_step_begin()
            if rank == 1:
                time.sleep(SLOW_S)
            timer.start()
            model(torch.randn(8, 32)).square().mean().backward()
            timer.stop()
            whole_steps.append(time.perf_counter() - started)
        metrics = efficiency.epoch_metrics(
            samples=8 * STEPS, step_times_s=timer.step_times_s(), epoch_time_s=1.0, rank=rank
        )
        results.put((rank, metrics, whole_steps))
    finally:
        dist.destroy_process_group()


def test_the_rank_that_makes_the_others_wait_has_the_longest_own_step_time():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    ranks = [spawn.Process(target=_rank, args=(rank, port, results)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    try:
        got = dict(
            (rank, (metrics, whole))
            for rank, metrics, whole in (results.get(timeout=60) for _ in ranks)
        )
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    metrics, rank0_whole = got[0]
    per_rank = {key: value for key, value in metrics.items() if key.startswith("rank")}
    assert len(per_rank) == 4
    assert all(got[1][0][key] == value for key, value in per_rank.items())  # every rank has all
    # Whole steps (after the first, which waits at start-up) take equally long on both ranks:
    # rank 0 waits in the all-reduce for rank 1's gradients.
    assert min(rank0_whole[1:]) > 0.8 * SLOW_S
    # Its own step time leaves that wait out; rank 1's holds its slow batch.
    assert metrics["rank1_step_time_median_s"] >= SLOW_S
    assert metrics["rank0_step_time_median_s"] < SLOW_S / 2
