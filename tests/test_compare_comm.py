"""Memory and communication per rank in compare and the grouped grid comparison: what a
`bench --grid nodes=1,2 --grid train.strategy=ddp,hsdp,tp` run shows per node count and strategy,
read from runs this test logs into a real MLflow SQLite store as the grid's children (the figures
as rayapp's loop logs them: `param_bytes_per_rank` once at the end, `comm_bytes_per_step` and
`peak_mem_mb` each epoch)."""

from __future__ import annotations

import csv
import io
import json

import pytest
from click.testing import CliRunner

from rayapp.cli.app import main
from rayapp.reports.compare import load_summaries
from rayapp.reports.compare_table import render
from rayapp.reports.grid import (
    TAG_AXIS_PREFIX,
    TAG_GRID_AXES,
    TAG_GRID_POINT,
    best_points,
    best_tags,
    group_by_axis,
    load_grid_runs,
    render_grid,
)

MIB = 2**20
POINTS = {  # (nodes, strategy) -> param bytes per rank, comm bytes per steady step
    ("1", "ddp"): (4 * MIB, 0.0),
    ("2", "ddp"): (4 * MIB, 8 * MIB),
    ("2", "hsdp"): (2 * MIB, 12 * MIB),
    ("2", "tp"): (2 * MIB, 3 * MIB),
}
PEAK_MB = {"ddp": 700.0, "hsdp": 600.0, "tp": 650.0}


@pytest.fixture
def grid_store(tmp_path):
    """A grid parent and one finished child per point; the first epoch's comm count differs (the
    strategy sets up its buffers), so a figure taken from it would show."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("rayapp")
    parent = client.create_run(experiment, tags={"rayapp.sweep": "true"}).info.run_id
    children = {}
    for (nodes, strategy), (param_bytes, comm_bytes) in POINTS.items():
        label = f"nodes={nodes} train.strategy={strategy}"
        run_id = client.create_run(
            experiment,
            tags={
                "mlflow.parentRunId": parent,
                TAG_GRID_AXES: "nodes,train.strategy",
                TAG_GRID_POINT: label,
                TAG_AXIS_PREFIX + "nodes": nodes,
                TAG_AXIS_PREFIX + "train.strategy": strategy,
            },
        ).info.run_id
        world = str(2 * int(nodes))
        params = {
            "job": "mlp_synthetic",
            "nodes": nodes,
            "world_size": world,
            "workers_per_node": "2",
            "backend": "gloo",
            "strategy": strategy,
            "scaling": "strong",
        }
        metrics = [Metric("param_bytes_per_rank", param_bytes, 0, 2)]
        for step, (comm, peak) in enumerate(
            [(comm_bytes * 3, PEAK_MB[strategy] - 50), (comm_bytes, PEAK_MB[strategy])]
            + [(comm_bytes, PEAK_MB[strategy] - 10)]
        ):
            metrics += [
                Metric("epoch_time_s", 2.0 / int(nodes), 0, step),
                Metric("samples_per_s", 1000.0 * int(nodes), 0, step),
                Metric("comm_bytes_per_step", comm, 0, step),
                Metric("peak_mem_mb", peak, 0, step),
            ]
        client.log_batch(run_id, metrics=metrics, params=[Param(k, v) for k, v in params.items()])
        client.set_terminated(run_id)
        children[(nodes, strategy)] = run_id
    client.set_terminated(parent)
    return uri, parent, children


def test_summaries_carry_bytes_per_rank_and_per_step(grid_store):
    uri, parent, children = grid_store
    summaries = {s.run_id: s for s in load_summaries(uri, parent_run_id=parent)}
    for point, (param_bytes, comm_bytes) in POINTS.items():
        summary = summaries[children[point]]
        assert summary.param_bytes_per_rank == param_bytes
        assert summary.comm_bytes_per_step == comm_bytes  # steady epochs: the first excluded
        assert summary.peak_mem_mb == PEAK_MB[point[1]]


def test_table_shows_megabytes_csv_and_json_keep_bytes(grid_store):
    uri, parent, children = grid_store
    summaries = load_summaries(uri, parent_run_id=parent)
    markdown = render(summaries, "markdown").splitlines()
    headers = [cell.strip() for cell in markdown[0].strip("|").split("|")]
    param_at, comm_at = headers.index("param MB/rank"), headers.index("comm MB/step")
    rows = {
        (cells[headers.index("nodes")], cells[headers.index("strategy")]): cells
        for cells in ([c.strip() for c in line.strip("|").split("|")] for line in markdown[2:])
    }
    assert rows[("2", "hsdp")][param_at] == "2.00"
    assert rows[("2", "hsdp")][comm_at] == "12.00"
    assert rows[("2", "tp")][comm_at] == "3.00"
    assert rows[("1", "ddp")][comm_at] == "0.00"  # a logged zero is a figure, not a dash

    by_run = {row["run_id"]: row for row in csv.DictReader(io.StringIO(render(summaries, "csv")))}
    tp_row = by_run[children[("2", "tp")]]
    assert float(tp_row["comm_bytes_per_step"]) == 3 * MIB
    assert float(tp_row["param_bytes_per_rank"]) == 2 * MIB
    logged = {run["run_id"]: run for run in json.loads(render(summaries, "json"))}
    assert logged[children[("2", "hsdp")]]["comm_bytes_per_step"] == 12 * MIB

    table = render(summaries, "table")
    assert "comm MB/step" in table and "param MB/rank" in table


def test_a_run_that_logged_neither_shows_dashes(tmp_path):
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("rayapp")).info.run_id
    params = {"job": "script", "nodes": "1", "world_size": "2", "strategy": "ddp"}
    client.log_batch(
        run_id,
        metrics=[Metric("epoch_time_s", 1.0, 0, step) for step in range(2)],
        params=[Param(k, v) for k, v in params.items()],
    )
    client.set_terminated(run_id)
    (summary,) = load_summaries(uri, run_ids=[run_id])
    markdown = render([summary], "markdown").splitlines()
    headers = [cell.strip() for cell in markdown[0].strip("|").split("|")]
    cells = [cell.strip() for cell in markdown[2].strip("|").split("|")]
    assert cells[headers.index("param MB/rank")] == "-"
    assert cells[headers.index("comm MB/step")] == "-"


def test_grid_groups_memory_and_comm_by_strategy_and_names_the_cheapest(grid_store):
    uri, _parent, children = grid_store
    runs = load_grid_runs(uri, list(children.values()))
    by_strategy = {row.value: row for row in group_by_axis(runs)["train.strategy"]}
    assert by_strategy["ddp"].means["comm_bytes_per_step"] == pytest.approx(4 * MIB)  # 0 and 8
    assert by_strategy["hsdp"].means["param_bytes_per_rank"] == 2 * MIB
    assert by_strategy["tp"].means["peak_mem_mb"] == PEAK_MB["tp"]  # the highest epoch's
    by_nodes = {row.value: row for row in group_by_axis(runs)["nodes"]}
    assert by_nodes["2"].means["comm_bytes_per_step"] == pytest.approx((8 + 12 + 3) / 3 * MIB)

    best = {b.metric: b for b in best_points(runs)}
    assert best["comm_bytes_per_step"].label == "nodes=1 train.strategy=ddp"
    # hsdp and tp tie; the first point of the grid's order wins
    assert best["param_bytes_per_rank"].label == "nodes=2 train.strategy=hsdp"
    assert best["peak_mem_mb"].label == "nodes=2 train.strategy=hsdp"
    assert best_tags(runs)["rayapp.best.peak_mem_mb"] == "nodes=2 train.strategy=hsdp (600)"

    table = render_grid(runs, "table")
    assert "comm_bytes_per_step (min)" in table
    assert "param_bytes_per_rank (min)" in table
    hsdp_line = next(line for line in table.splitlines() if line.startswith("hsdp"))
    assert "12,582,912" in hsdp_line  # 12 MiB of collectives per step, in bytes as logged
    grid_csv = list(csv.DictReader(io.StringIO(render_grid(runs, "csv"))))
    tp_row = next(r for r in grid_csv if r["axis"] == "train.strategy" and r["value"] == "tp")
    assert float(tp_row["comm_bytes_per_step"]) == 3 * MIB


def test_compare_parent_shows_each_points_bytes_and_the_grouped_ones(grid_store):
    uri, parent, _children = grid_store
    result = CliRunner().invoke(
        main, ["compare", "--parent", parent, "--tracking-uri", uri, "--format", "markdown"]
    )
    assert result.exit_code == 0, result.output
    assert "| comm MB/step |" in result.output
    assert "**by train.strategy (mean over the other axes)**" in result.output
    assert "best comm_bytes_per_step (min): nodes=1 train.strategy=ddp" in result.output
