"""What a run's MLflow records say beyond its epoch times: where a steady epoch's time goes, how
busy each node was, the FLOP rate and MFU, which rank was slowest and which node's link, and
where the whole run's wall time went (goodput). Steady means the first epoch excluded, as
everywhere in the comparison."""

from __future__ import annotations

import ipaddress
import math
import re
import statistics
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rayapp.tracking.goodput import GOODPUT, PARTS, RUN_WALL
from rayapp.tracking.run import TAG_NODE_IPS, TAG_PEAK_TFLOPS_SOURCE

if TYPE_CHECKING:
    from mlflow.entities import Run
    from mlflow.tracking import MlflowClient

RANK_STEP_MEDIAN = re.compile(r"rank(\d+)_step_time_median_s")
RANK_LINK = re.compile(r"rank(\d+)_link_s")


def steady_epochs(client: MlflowClient, run_id: str) -> set[int]:
    """The epochs a steady figure is taken over: all but the first (the same rule as
    rayapp.reports.tables.steady_median)."""
    epochs = sorted(m.step for m in client.get_metric_history(run_id, "epoch_time_s"))
    return set(epochs[1:] if len(epochs) > 1 else epochs)


def _steady_history(
    client: MlflowClient, run_id: str, key: str, steady_steps: set[int]
) -> dict[int, float]:
    """A per-epoch metric's finite values at the steady epochs, by epoch (NaN marks 'not
    measured')."""
    return {
        m.step: m.value
        for m in client.get_metric_history(run_id, key)
        if m.step in steady_steps and math.isfinite(m.value)
    }


def _median_or_nan(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else math.nan


def time_breakdown(client: MlflowClient, run_id: str, epoch_time_s: float) -> dict[str, Any]:
    """compute_s, comm_s, data_s and other_s of the median steady epoch (see RunSummary)."""
    steady = steady_epochs(client, run_id)
    compute = _steady_history(client, run_id, "compute_time_s", steady)
    comm = _steady_history(client, run_id, "comm_time_s", steady)
    data = _steady_history(client, run_id, "data_time_s", steady)
    # compute_time_s spans forward, backward and step, so it holds the all-reduce that backward does
    # not hide; take comm out per epoch so the bar does not count it twice.
    compute_only = _median_or_nan(
        max(value - comm.get(step, 0.0), 0.0) for step, value in compute.items()
    )
    parts = {
        "compute_s": compute_only,
        "comm_s": _median_or_nan(comm.values()),
        "data_s": _median_or_nan(data.values()),
    }
    timed = sum(value for value in parts.values() if not math.isnan(value))
    return {**parts, "other_s": max(epoch_time_s - timed, 0.0)}


def _address_order(node: str) -> tuple[int, Any]:
    try:
        return (0, ipaddress.ip_address(node))
    except ValueError:  # a node named otherwise (a hostname): after the addresses, by name
        return (1, node)


def cpu_by_node(client: MlflowClient, run: Run) -> dict[str, float]:
    """Mean CPU utilisation of each node over the run, from the system metrics its sampler
    logged."""
    prefix, suffix = "system/", "/cpu_utilization_percentage"
    nodes = [
        key[len(prefix) : -len(suffix)]
        for key in run.data.metrics
        if key.startswith(prefix) and key.endswith(suffix)
    ]
    means = {}
    for node in sorted(nodes, key=_address_order):
        history = client.get_metric_history(run.info.run_id, f"{prefix}{node}{suffix}")
        values = [m.value for m in history if math.isfinite(m.value)]
        means[node] = statistics.fmean(values) if values else math.nan
    return means


def efficiency(client: MlflowClient, run: Run) -> dict[str, Any]:
    """tflops_per_s and mfu of the median steady epoch, and where the peak came from."""
    run_id = run.info.run_id
    steady = steady_epochs(client, run_id)
    return {
        "tflops_per_s": _median_or_nan(
            _steady_history(client, run_id, "tflops_per_s", steady).values()
        ),
        "mfu": _median_or_nan(_steady_history(client, run_id, "mfu", steady).values()),
        "peak_tflops": _median_or_nan(
            _steady_history(client, run_id, "peak_tflops", steady).values()
        ),
        "peak_source": run.data.tags.get(TAG_PEAK_TFLOPS_SOURCE, ""),
    }


def goodput(run: Run) -> dict[str, Any]:
    """run_wall_s, goodput and the wall time's parts (goodput_*_s, in the order they stack), as
    the driver logged them at the run's end; NaN and no parts for a run without them (one that
    failed, or from before they were logged)."""
    metrics = run.data.metrics
    return {
        "run_wall_s": metrics.get(RUN_WALL, math.nan),
        "goodput": metrics.get(GOODPUT, math.nan),
        "goodput_parts": {name: metrics[name] for name in PARTS if name in metrics},
    }


def stragglers(client: MlflowClient, run: Run) -> dict[str, Any]:
    """The spread of the ranks' step times: the slowest rank's median step time over the
    median rank's (1.0: all alike), which rank that was and on which node. Each rank's figure
    is the median over steady epochs of its ``rank<N>_step_time_median_s``."""
    node_ips = run.data.tags.get(TAG_NODE_IPS, "").split(",")
    spread, slowest, node = _slowest(_steady_by_rank(client, run, RANK_STEP_MEDIAN), node_ips)
    return {"step_time_spread": spread, "slowest_rank": slowest, "slowest_node": node}


def links(client: MlflowClient, run: Run) -> dict[str, Any]:
    """The spread of the nodes' link times (``rank<N>_link_s``, rayapp.train.link_probe): the
    slowest node's median over the median node's, and that node; NaN and "" for a run on fewer
    than 3 nodes, which times none."""
    node_ips = run.data.tags.get(TAG_NODE_IPS, "").split(",")
    spread, _, node = _slowest(_steady_by_rank(client, run, RANK_LINK), node_ips)
    return {"link_spread": spread, "slowest_link_node": node}


def _steady_by_rank(client: MlflowClient, run: Run, pattern: re.Pattern[str]) -> dict[int, float]:
    """rank -> the median over steady epochs of its per-rank metric `pattern` names."""
    steady = steady_epochs(client, run.info.run_id)
    by_rank: dict[int, float] = {}
    for key in run.data.metrics:
        matched = pattern.fullmatch(key)
        if matched:
            history = _steady_history(client, run.info.run_id, key, steady)
            if history:
                by_rank[int(matched.group(1))] = statistics.median(history.values())
    return by_rank


def _slowest(by_rank: dict[int, float], node_ips: list[str]) -> tuple[float, int | None, str]:
    """(the largest figure over the median one, its rank, that rank's node)."""
    if len(by_rank) < 2:  # one rank (or none timed): nobody to be slower than
        return math.nan, None, ""
    slowest = max(sorted(by_rank), key=by_rank.__getitem__)
    node = node_ips[slowest] if slowest < len(node_ips) else ""
    return by_rank[slowest] / statistics.median(by_rank.values()), slowest, node
