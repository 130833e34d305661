"""`rayapp doctor`: what every node of the cluster has, what it reaches, and how fast each pair
of nodes all-reduces.

Per node (a Ray task pinned there): Python, Ray, torch, CUDA and NCCL versions, its GPUs, the
free space on the storage path, and whether the storage path and the MLflow store or server are
reachable from there (the marker files and server question of :mod:`rayapp.launch.node_check`).
Per pair of nodes: a two-rank process group (Gloo; NCCL when both nodes have GPUs) between two
actors pinned to those nodes, which all-reduce one number (latency) and a 16 MiB buffer
(bandwidth). The pairs run one after another, so they do not share the network while measured.
Each actor first runs the caller's `prepare_rank` (the CLI passes rayapp.train.socket_ifname's
pinning, as training workers do it, so Gloo does not rendezvous over the loopback address a
host name resolves to on stock Debian/Ubuntu).

A pair far below the others (less than half the median bandwidth of the other pairs, or more
than twice their median latency and 1 ms more) is flagged, and so is a node all of whose pairs
are flagged (with 3 nodes or more: that is where the slow link is). A flag is a warning; a node
that fails a check, or a pair whose test fails, is a failure.
"""

from __future__ import annotations

import itertools
import shutil
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rayapp.launch.node_check import (
    NodeCheck,
    NodeReport,
    inspect_node,
    markers_in,
    packages_problem,
    storage_directory,
    storage_problem,
    store_directory,
    tracking_problem,
)

LATENCY_ROUNDS = 20
BANDWIDTH_BYTES = 16 * 2**20
BANDWIDTH_ROUNDS = 5
PAIR_TIMEOUT_S = 120.0
"""A pair's process group must form and finish its rounds within this (a blocked port, a wrong
interface: Gloo and NCCL would otherwise wait for their own, much longer timeout)."""
SLOW_BANDWIDTH_RATIO = 0.5
SLOW_LATENCY_RATIO = 2.0
SLOW_LATENCY_MARGIN_S = 1e-3
"""Sub-millisecond latencies jitter by multiples of themselves; a flag needs a real difference."""


@dataclass(frozen=True)
class NodeFacts:
    """What one node says about itself."""

    report: NodeReport
    node_id: str
    cuda: str | None
    nccl: str | None
    gpus: tuple[str, ...]
    free_bytes: int | None
    """Free space on the storage path there; None for an object store or a path it lacks."""

    @property
    def ip(self) -> str:
        return self.report.node_ip


@dataclass(frozen=True)
class PairResult:
    nodes: tuple[str, str]
    backend: str
    latency_s: float | None = None
    bandwidth_bytes_s: float | None = None
    error: str | None = None


@dataclass
class Diagnosis:
    nodes: list[NodeFacts]
    storage_dir: str | None = None
    """The storage path's directory (None: an object store), checked for on every node."""
    store_dir: str | None = None
    """The MLflow file store's directory (None: a tracking server)."""
    problems: list[str] = field(default_factory=list)
    """Failures: one line each."""
    pairs: list[PairResult] = field(default_factory=list)
    slow_pairs: set[tuple[str, str]] = field(default_factory=set)
    slow_nodes: set[str] = field(default_factory=set)

    @property
    def failed(self) -> bool:
        return bool(self.problems) or any(pair.error for pair in self.pairs)


# ---- on each node -----------------------------------------------------------------------------


def node_facts(
    node_ip: str, node_id: str, check: NodeCheck, credentials: Mapping[str, str], storage_dir: str
) -> NodeFacts:
    """Run on the node itself (a Ray task pinned there)."""
    import torch

    report = inspect_node(node_ip, check, credentials)
    cuda = torch.cuda.is_available()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    gpus = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    free = None
    if storage_dir:
        try:
            free = shutil.disk_usage(storage_dir).free
        except OSError:  # the path does not exist there
            free = None
    return NodeFacts(report, node_id, torch.version.cuda if cuda else None, nccl, gpus, free)


class PairRank:
    """One end of a pair test: an actor on one node that joins two-rank process groups."""

    def __init__(self, prepare: Callable[[], None] | None = None) -> None:
        if prepare is not None:  # before any process group reads its environment
            prepare()

    def address(self) -> tuple[str, int]:
        import socket

        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind((ip, 0))
            return ip, probe.getsockname()[1]

    def measure(self, rank: int, master: tuple[str, int], backend: str) -> tuple[float, float]:
        """(latency s, bandwidth bytes/s) of all-reduces between this rank and its peer."""
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        dist.init_process_group(
            backend,
            init_method=f"tcp://{master[0]}:{master[1]}",
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=PAIR_TIMEOUT_S),
        )
        try:
            device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")

            def timed(tensor: torch.Tensor, rounds: int) -> float:
                dist.all_reduce(tensor)  # warm-up: connections, buffers
                times = []
                for _ in range(rounds):
                    dist.barrier()
                    started = time.perf_counter()
                    dist.all_reduce(tensor)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    times.append(time.perf_counter() - started)
                return statistics.median(times)

            latency = timed(torch.ones(1, device=device), LATENCY_ROUNDS)
            buffer = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32, device=device)
            return latency, BANDWIDTH_BYTES / timed(buffer, BANDWIDTH_ROUNDS)
        finally:
            dist.destroy_process_group()


# ---- what the figures mean --------------------------------------------------------------------


def slow_pairs(pairs: list[PairResult]) -> set[tuple[str, str]]:
    """Pairs far below the others: under half the others' median bandwidth, or over twice their
    median latency (and 1 ms more). Each pair is held against the median of the others, so one
    slow node, which slows every pair it is in, does not drag the yardstick down with it."""
    measured = [
        (p.nodes, p.latency_s, p.bandwidth_bytes_s)
        for p in pairs
        if p.error is None and p.latency_s is not None and p.bandwidth_bytes_s is not None
    ]
    slow: set[tuple[str, str]] = set()
    for index, (nodes, latency, bandwidth) in enumerate(measured):
        others = measured[:index] + measured[index + 1 :]
        if not others:
            break
        usual_bandwidth = statistics.median(b for _, _, b in others)
        usual_latency = statistics.median(lat for _, lat, _ in others)
        if (
            bandwidth < SLOW_BANDWIDTH_RATIO * usual_bandwidth
            or latency > SLOW_LATENCY_RATIO * usual_latency + SLOW_LATENCY_MARGIN_S
        ):
            slow.add(nodes)
    return slow


def slow_nodes(pairs: list[PairResult], slow: set[tuple[str, str]]) -> set[str]:
    """Nodes all of whose pairs are slow, where there are other pairs to tell them by (3 nodes or
    more): the slow link is that node's."""
    nodes = {node for pair in pairs for node in pair.nodes}
    if len(nodes) < 3:
        return set()
    return {
        node
        for node in nodes
        if all(pair.nodes in slow for pair in pairs if node in pair.nodes and pair.error is None)
        and any(node in pair.nodes for pair in pairs if pair.error is None)
    }


# ---- the driver's side ------------------------------------------------------------------------


def diagnose(
    storage: str,
    tracking_uri: str,
    *,
    credentials: Mapping[str, str],
    pairs: bool = True,
    on_status: Any = None,
    prepare_rank: Callable[[], None] | None = None,
) -> Diagnosis:
    """Check every alive node of the connected cluster; with `pairs`, all-reduce between each
    pair of nodes too (`prepare_rank`: run in each pair's actor before its process group)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rayapp.tracking.access import is_server_uri

    status = on_status or (lambda _: None)
    storage_dir = storage_directory(storage) or ""
    shared = [d for d in (storage_dir or None, store_directory(tracking_uri)) if d is not None]
    alive = sorted(
        (n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeManagerAddress"]
    )
    status(f"checking {len(alive)} node(s): versions, GPUs, storage, MLflow")
    task = ray.remote(num_cpus=0, max_retries=0)(node_facts)
    with markers_in(shared) as markers:
        check = NodeCheck(
            markers=markers, tracking_uri=tracking_uri if is_server_uri(tracking_uri) else None
        )
        refs = [
            task.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            ).remote(
                node["NodeManagerAddress"], node["NodeID"], check, dict(credentials), storage_dir
            )
            for node in alive
        ]
        facts: list[NodeFacts] = ray.get(refs, timeout=PAIR_TIMEOUT_S)
    diagnosis = Diagnosis(
        nodes=facts, storage_dir=storage_dir or None, store_dir=store_directory(tracking_uri)
    )
    driver = inspect_node(ray.util.get_node_ip_address(), NodeCheck(), {})
    reports = [f.report for f in facts]
    for problem in (
        packages_problem(driver, reports),
        storage_problem(storage, storage_dir, driver.node_ip, reports) if storage_dir else None,
        tracking_problem(tracking_uri, driver.node_ip, reports, credentials),
    ):
        if problem:
            diagnosis.problems.append(problem)
    if pairs and len(facts) > 1:
        diagnosis.pairs = measure_pairs(facts, status, prepare_rank)
        diagnosis.slow_pairs = slow_pairs(diagnosis.pairs)
        diagnosis.slow_nodes = slow_nodes(diagnosis.pairs, diagnosis.slow_pairs)
    return diagnosis


def measure_pairs(
    facts: list[NodeFacts], status: Any, prepare_rank: Callable[[], None] | None = None
) -> list[PairResult]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rayapp.errors import cause_line

    gpu = all(f.gpus for f in facts)
    backend = "nccl" if gpu else "gloo"
    actor = ray.remote(num_cpus=0, num_gpus=1 if gpu else 0, max_restarts=0)(PairRank)
    node_ids = {f.ip: f.node_id for f in facts}

    def start(ip: str) -> Any:
        strategy = NodeAffinitySchedulingStrategy(node_ids[ip], soft=False)
        return actor.options(scheduling_strategy=strategy).remote(prepare_rank)

    ranks = {ip: start(ip) for ip in sorted(node_ids)}
    results = []
    try:
        for first, second in itertools.combinations(sorted(ranks), 2):
            status(f"all-reduce between {first} and {second} ({backend})")
            try:
                master = ray.get(ranks[first].address.remote(), timeout=PAIR_TIMEOUT_S)
                refs = [
                    ranks[node].measure.remote(rank, master, backend)
                    for rank, node in enumerate((first, second))
                ]
                (latency, bandwidth), _ = ray.get(refs, timeout=PAIR_TIMEOUT_S)
                results.append(PairResult((first, second), backend, latency, bandwidth))
            except Exception as exc:  # the group did not form, a node is gone, a timeout
                results.append(PairResult((first, second), backend, error=cause_line(exc)))
                for node in (first, second):  # it may still wait in the group: a fresh one
                    ray.kill(ranks[node])
                    ranks[node] = start(node)
    finally:
        for handle in ranks.values():
            ray.kill(handle)
    return results


def preflight(
    storage: str, tracking_uri: str, *, credentials: Mapping[str, str], on_status: Any = None
) -> None:
    """`rayapp submit --preflight`: the per-node checks of :func:`diagnose`, before training;
    RayappError with the first problem's line when one fails."""
    from rayapp.errors import RayappError

    diagnosis = diagnose(
        storage, tracking_uri, credentials=credentials, pairs=False, on_status=on_status
    )
    if diagnosis.problems:
        raise RayappError(f"preflight: {diagnosis.problems[0]}")
