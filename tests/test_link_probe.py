"""Timing each node's link at an epoch's end: which ranks lead their node, and that the leaders
(only they) get a figure, in real processes on a Gloo group. A slow link named by it is tested
on the test hosts (tests/test_hosts_faults.py), where one host's link can be slowed."""

from __future__ import annotations

import math
import multiprocessing
from pathlib import Path

import torch.distributed as dist

from rayapp.train.link_probe import LinkProbe, node_leaders

# Four ranks on three "nodes": ranks 0 and 1 share one.
NODES = ["a", "a", "b", "c"]


def test_the_first_rank_on_each_node_leads_it():
    assert node_leaders(NODES) == [0, 2, 3]
    assert node_leaders(["b", "a", "b", "a"]) == [0, 1]


def _rank(rank: int, store: str, nodes: list[str], results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=len(nodes))
    try:
        probe = LinkProbe(nodes, rank, timeout_s=60)
        results.put((rank, [probe.measure() for _ in range(2)]))
    finally:
        dist.destroy_process_group()


def _run(nodes: list[str], store: Path) -> dict[int, list[float]]:
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    ranks = [
        spawn.Process(target=_rank, args=(rank, str(store), nodes, results))
        for rank in range(len(nodes))
    ]
    for process in ranks:
        process.start()
    try:
        return dict(results.get(timeout=60) for _ in ranks)
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


def test_node_leaders_time_their_link_and_the_other_ranks_do_not(tmp_path):
    got = _run(NODES, tmp_path / "store")
    for rank in (0, 2, 3):
        assert all(0 < seconds < 10 for seconds in got[rank]), got
    assert all(math.isnan(seconds) for seconds in got[1]), got


def test_two_nodes_are_not_timed_a_slow_link_has_two_ends(tmp_path):
    got = _run(["a", "b"], tmp_path / "store")
    assert all(math.isnan(seconds) for times in got.values() for seconds in times), got
