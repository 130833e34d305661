"""compare's MFU and straggler columns on runs with known per-epoch figures, logged by the test
into a real MLflow SQLite store (the figures themselves are measured in test_efficiency.py and
the 2-node integration run)."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner
from conftest import migrated_store
from mlflow.tracking import MlflowClient
from test_compare import log_run

from rayapp.cli import main
from rayapp.reports.compare import load_summaries
from rayapp.reports.compare_table import render
from rayapp.tracking.run import TAG_NODE_IPS, TAG_PEAK_TFLOPS_SOURCE


def epochs(world: int, slow_rank: int | None, mfu: float, n: int = 4) -> list[dict]:
    """Ranks take 0.10 s a step, `slow_rank` 0.15 s, except in the first (warm-up) epoch, where
    rank 0 is slowest of all: compare must leave that epoch out."""
    result = []
    for epoch in range(n):
        metrics = {
            "epoch_time_s": 1.0,
            "samples_per_s": 100.0 * world,
            "comm_time_s": 0.1,
            "peak_mem_mb": 100.0,
            "tflops_per_s": (0.1 if epoch == 0 else 1.0) * mfu * 10.0 * world,
            "peak_tflops": 10.0 * world,
            "mfu": (0.1 if epoch == 0 else 1.0) * mfu,
        }
        for rank in range(world):
            median = 0.15 if rank == slow_rank else 0.10
            if epoch == 0 and rank == 0:
                median = 1.0
            metrics[f"rank{rank}_step_time_median_s"] = median
            metrics[f"rank{rank}_step_time_p95_s"] = 2 * median
        result.append(metrics)
    return result


@pytest.fixture
def store(tmp_path):
    uri = migrated_store(tmp_path / "mlflow.db")
    client = MlflowClient(uri)
    ids = {}
    for world, slow_rank, mfu in [(1, None, 0.40), (2, 1, 0.35), (4, 2, 0.30)]:
        run_id = log_run(
            uri, job="mlp", world=world, scaling="strong", epochs=epochs(world, slow_rank, mfu)
        )
        ips = ",".join(f"127.0.0.{rank + 2}" for rank in range(world))
        client.set_tag(run_id, TAG_NODE_IPS, ips)
        client.set_tag(run_id, TAG_PEAK_TFLOPS_SOURCE, "measured:matmul")
        ids[world] = run_id
    return uri, ids


def test_mfu_per_node_count_and_the_slowest_rank_named_with_its_node(store):
    uri, _ = store
    summaries = {s.world_size: s for s in load_summaries(uri, experiment="cmp")}
    assert {world: s.mfu for world, s in summaries.items()} == pytest.approx(
        {1: 0.40, 2: 0.35, 4: 0.30}
    )
    assert summaries[4].tflops_per_s == pytest.approx(0.30 * 40.0)
    assert summaries[4].peak_source == "measured:matmul"

    two, four = summaries[2], summaries[4]
    assert (two.slowest_rank, two.slowest_node) == (1, "127.0.0.3")
    assert two.step_time_spread == pytest.approx(0.15 / 0.125)  # median of two: their mean
    assert (four.slowest_rank, four.slowest_node) == (2, "127.0.0.4")
    assert four.step_time_spread == pytest.approx(1.5)
    assert four.straggler == "1.50x rank 2 @ 127.0.0.4"
    # One rank has nobody to be slower than.
    assert math.isnan(summaries[1].step_time_spread) and summaries[1].straggler == "-"


def test_the_columns_in_every_format(store):
    uri, ids = store
    summaries = load_summaries(uri, experiment="cmp")
    markdown = render(summaries, "markdown")
    (line,) = [line for line in markdown.splitlines() if line.startswith("| mlp | 4 |")]
    assert "| 30.0% |" in line and "| 1.50x rank 2 @ 127.0.0.4 |" in line
    rows = {row["run_id"]: row for row in json.loads(render(summaries, "json"))}
    assert rows[ids[2]]["slowest_node"] == "127.0.0.3"
    assert rows[ids[2]]["mfu"] == pytest.approx(0.35)
    result = CliRunner().invoke(
        main, ["compare", "--experiment", "cmp", "--tracking-uri", uri, "--format", "csv"]
    )
    assert result.exit_code == 0, result.output
    assert "slowest_node" in result.output.splitlines()[0]
    assert "127.0.0.4" in result.output
    table = render(summaries, "table")
    assert "MFU" in table and "slowest rank" in table


def test_runs_without_the_figures_show_dashes(tmp_path):
    # Runs logged before these metrics existed: compare still works and says "not measured".
    uri = migrated_store(tmp_path / "mlflow.db")
    log_run(uri, job="old", world=2, scaling="strong", epochs=[{"epoch_time_s": 1.0}] * 2)
    (summary,) = load_summaries(uri, experiment="cmp")
    assert math.isnan(summary.mfu) and summary.straggler == "-"
    (line,) = [
        line for line in render([summary], "markdown").splitlines() if line.startswith("| old")
    ]
    assert line.count("| - |") >= 3
    assert summary.slow_link == "-"


def test_the_node_with_the_slowest_link_is_named(tmp_path):
    # Three nodes, a rank each; the third's link takes 10x the others' (its warm-up epoch, the
    # first, is left out like every figure's).
    uri = migrated_store(tmp_path / "mlflow.db")
    warm_up = {
        "epoch_time_s": 1.0,
        "rank0_link_s": 0.9,
        "rank1_link_s": 0.002,
        "rank2_link_s": 0.02,
    }
    steady = {
        "epoch_time_s": 1.0,
        "rank0_link_s": 0.002,
        "rank1_link_s": 0.003,
        "rank2_link_s": 0.03,
    }
    run_id = log_run(uri, job="mlp", world=3, scaling="strong", epochs=[warm_up] + [steady] * 3)
    MlflowClient(uri).set_tag(run_id, TAG_NODE_IPS, "127.0.0.2,127.0.0.3,127.0.0.4")
    (summary,) = load_summaries(uri, experiment="cmp")
    assert summary.slowest_link_node == "127.0.0.4"
    assert summary.link_spread == pytest.approx(10.0)
    assert summary.slow_link == "10.00x @ 127.0.0.4"
    assert "| 10.00x @ 127.0.0.4 |" in render([summary], "markdown")
    assert json.loads(render([summary], "json"))[0]["slowest_link_node"] == "127.0.0.4"
