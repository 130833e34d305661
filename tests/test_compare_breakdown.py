"""Why a run scales or not: the time breakdown, start-up and per-node CPU columns of `compare`, and
the plot's breakdown panel, on runs logged by the test into a real MLflow SQLite store."""

from __future__ import annotations

import csv
import io
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
from rayapp.reports.plot import (
    BREAKDOWN_TITLE,
    GOODPUT_TITLE,
    SCALING_TITLES,
    scaling_figure,
    time_breakdown_figure,
)
from rayapp.tracking.goodput import PARTS, breakdown

PNG = b"\x89PNG\r\n\x1a\n"
STARTUP = {"startup_cluster_s": 4.3, "startup_workers_s": 2.5, "time_to_first_step_s": 9.7}
# What the workers measured of a 60 s run (the driver adds the wall time and other).
GOODPUT_PARTS = {
    "goodput_startup_s": 9.7,
    "goodput_compute_s": 30.0,
    "goodput_comm_s": 6.0,
    "goodput_data_s": 3.0,
    "goodput_checkpoint_s": 2.0,
    "goodput_restart_lost_s": 5.0,
}
# Three nodes, one numbered past 9, so address order (…2, …3, …10) differs from text order
# (…10, …2, …3).
CPU_SAMPLES = {
    "127.0.0.2": [80.0, 90.0, 91.0],
    "127.0.0.3": [85.0, 85.0],
    "127.0.0.10": [40.0, 60.0],
}


def timed_epochs(
    epoch_s: float, compute_s: float, comm_s: float, data_s: float, n: int = 4
) -> list[dict]:
    # The first epoch is warm-up with other numbers altogether: the breakdown must leave it out.
    first = {
        "epoch_time_s": 9.0,
        "samples_per_s": 10.0,
        "compute_time_s": 7.0,
        "comm_time_s": 1.0,
        "data_time_s": 0.5,
    }
    steady = {
        "epoch_time_s": epoch_s,
        "samples_per_s": 1000.0 / epoch_s,
        "compute_time_s": compute_s,
        "comm_time_s": comm_s,
        "data_time_s": data_s,
    }
    return [first] + [steady] * (n - 1)


def log_extras(uri: str, run_id: str, once: dict[str, float], cpu: dict[str, list[float]]) -> None:
    """What a real run logs besides its epochs: start-up figures once, system metrics per sample."""
    client = MlflowClient(uri)
    for key, value in once.items():
        client.log_metric(run_id, key, value, step=0)
    for node, samples in cpu.items():
        for index, value in enumerate(samples):
            client.log_metric(
                run_id, f"system/{node}/cpu_utilization_percentage", value, step=index
            )
            client.log_metric(
                run_id, f"system/{node}/system_memory_usage_megabytes", 1000.0, step=index
            )


@pytest.fixture
def store(tmp_path):
    uri = migrated_store(tmp_path / "mlflow.db")
    ddp1 = log_run(
        uri, job="mlp", world=1, scaling="strong", epochs=timed_epochs(2.0, 1.6, 0.0, 0.2)
    )
    ddp2 = log_run(
        uri, job="mlp", world=2, scaling="strong", epochs=timed_epochs(1.0, 0.7, 0.2, 0.1)
    )
    log_extras(uri, ddp2, STARTUP | breakdown(60.0, GOODPUT_PARTS), CPU_SAMPLES)
    # FSDP-like: comm not measured (NaN), so it stays inside compute.
    fsdp = log_run(
        uri, job="fsdp", world=2, scaling="strong", epochs=timed_epochs(1.0, 0.7, math.nan, 0.1)
    )
    # The slowest rank's parts can exceed the slowest rank's epoch: other floors at 0.
    over = log_run(
        uri, job="over", world=2, scaling="strong", epochs=timed_epochs(1.0, 0.9, 0.0, 0.3)
    )
    # A run from before compute/data timings, start-up and system metrics were logged.
    old = log_run(
        uri,
        job="old",
        world=1,
        scaling="weak",
        epochs=[
            {"epoch_time_s": 3.0, "samples_per_s": 10.0},
            {"epoch_time_s": 2.0, "samples_per_s": 20.0},
        ],
    )
    return uri, {"ddp1": ddp1, "ddp2": ddp2, "fsdp": fsdp, "over": over, "old": old}


def summaries_by_run(uri: str) -> dict:
    return {s.run_id: s for s in load_summaries(uri, experiment="cmp")}


def test_breakdown_adds_up_to_the_epoch(store):
    uri, ids = store
    runs = summaries_by_run(uri)
    ddp2 = runs[ids["ddp2"]]
    assert ddp2.epoch_time_s == 1.0  # the steady median; the 9 s warm-up epoch left out
    assert (ddp2.compute_s, ddp2.comm_s, ddp2.data_s) == pytest.approx(
        (0.5, 0.2, 0.1)
    )  # comm taken out of compute
    assert ddp2.other_s == pytest.approx(0.2)
    assert ddp2.time_parts == pytest.approx(
        {"compute": 0.5, "comm": 0.2, "data": 0.1, "other": 0.2}
    )

    fsdp = runs[ids["fsdp"]]
    assert math.isnan(fsdp.comm_s) and fsdp.compute_s == pytest.approx(0.7)
    assert fsdp.time_parts["comm"] == 0.0

    old = runs[ids["old"]]
    assert math.isnan(old.compute_s) and math.isnan(old.data_s)
    assert old.other_s == pytest.approx(2.0)  # nothing timed: the whole epoch is "other"

    for key in ("ddp1", "ddp2", "fsdp", "old"):
        assert sum(runs[ids[key]].time_parts.values()) == pytest.approx(
            runs[ids[key]].epoch_time_s
        ), key

    over = runs[ids["over"]]
    assert over.other_s == 0.0  # floored, not negative
    assert sum(over.time_parts.values()) == pytest.approx(1.2)


def test_startup_and_cpu_per_node_columns(store):
    uri, ids = store
    runs = summaries_by_run(uri)
    ddp2 = runs[ids["ddp2"]]
    assert (ddp2.startup_cluster_s, ddp2.startup_workers_s, ddp2.time_to_first_step_s) == (
        4.3,
        2.5,
        9.7,
    )
    assert list(ddp2.cpu_percent_by_node) == [
        "127.0.0.2",
        "127.0.0.3",
        "127.0.0.10",
    ]  # address order
    assert ddp2.cpu_percent_by_node == pytest.approx(
        {"127.0.0.2": 87.0, "127.0.0.3": 85.0, "127.0.0.10": 50.0}
    )
    old = runs[ids["old"]]
    assert math.isnan(old.time_to_first_step_s) and old.cpu_percent_by_node == {}

    rows = {r["run_id"]: r for r in json.loads(render(list(runs.values()), "json"))}
    assert rows[ids["ddp2"]]["cpu_percent_by_node"]["127.0.0.10"] == pytest.approx(50.0)
    assert rows[ids["ddp2"]]["comm_s"] == pytest.approx(0.2)

    table = list(csv.DictReader(io.StringIO(render(list(runs.values()), "csv"))))
    by_id = {r["run_id"]: r for r in table}
    assert float(by_id[ids["ddp2"]]["startup_workers_s"]) == 2.5
    assert (
        by_id[ids["ddp2"]]["cpu_percent_by_node"]
        == "127.0.0.2: 87.0, 127.0.0.3: 85.0, 127.0.0.10: 50.0"
    )
    assert by_id[ids["old"]]["cpu_percent_by_node"] == "-"
    assert float(by_id[ids["ddp2"]]["other_s"]) == pytest.approx(0.2)


def test_compare_cli_shows_new_columns_and_dashes(store):
    uri, ids = store
    runner = CliRunner()
    markdown = runner.invoke(
        main, ["compare", ids["ddp2"], ids["old"], "--tracking-uri", uri, "--format", "markdown"]
    )
    assert markdown.exit_code == 0, markdown.output
    header, _, *rows = markdown.output.splitlines()
    titles = [cell.strip() for cell in header.strip("|").split("|")]
    assert titles[-5:] == ["cluster up s", "workers up s", "first step s", "cpu % per node", "run"]
    cells = {
        row.split("|")[-2].strip(): [c.strip() for c in row.strip("|").split("|")] for row in rows
    }
    assert cells[ids["ddp2"][:12]][-5:-1] == [
        "4.3",
        "2.5",
        "9.7",
        "127.0.0.2: 87, 127.0.0.3: 85, 127.0.0.10: 50",
    ]
    assert cells[ids["old"][:12]][-5:-1] == ["-", "-", "-", "-"]  # an old run: dashes, no crash

    table = runner.invoke(main, ["compare", ids["ddp2"], ids["old"], "--tracking-uri", uri])
    assert table.exit_code == 0, table.output
    row = next(
        line for line in table.output.splitlines() if ids["ddp2"][:12] in line
    )  # run ids are never cut
    assert "127.0.0.2: 87, 127.0.0.3: 85, 127.0.0.10: 50" in row and "9.7" in row


def test_scaling_figure_has_the_breakdown_panel(store):
    uri, ids = store
    summaries = load_summaries(uri, experiment="cmp")
    figure = scaling_figure(summaries)
    assert [axis.get_title() for axis in figure.axes] == [
        *SCALING_TITLES,
        BREAKDOWN_TITLE,
        GOODPUT_TITLE,
    ]
    breakdown = figure.axes[2]
    # One stacked bar per run, in the panel's order (by group, then world size): each adds up to its
    # epoch.
    bars = [
        container for container in breakdown.containers if len(container.patches) == len(summaries)
    ]
    assert len(bars) == 4  # compute, comm, data, other
    totals = [
        sum(parts)
        for parts in zip(
            *[[patch.get_height() for patch in bar.patches] for bar in bars], strict=True
        )
    ]
    by_label = dict(
        zip([label.get_text() for label in breakdown.get_xticklabels()], totals, strict=True)
    )
    mlp = {s.world_size: s for s in summaries if s.job == "mlp"}
    assert by_label["mlp, ddp\nworld 2\n2 nodes"] == pytest.approx(mlp[2].epoch_time_s)
    assert by_label["old, ddp\nworld 1\n1 node"] == pytest.approx(2.0)
    assert [axis.get_title() for axis in time_breakdown_figure(summaries).axes] == [BREAKDOWN_TITLE]


def test_goodput_is_a_column_and_a_stacked_bar_of_the_wall_time(store):
    uri, ids = store
    runs = summaries_by_run(uri)
    ddp2 = runs[ids["ddp2"]]
    assert ddp2.run_wall_s == 60.0 and ddp2.goodput == pytest.approx(0.5)
    assert list(ddp2.goodput_parts) == list(PARTS)  # stacked in that order
    assert ddp2.goodput_parts["goodput_other_s"] == pytest.approx(60.0 - 55.7)
    assert math.isnan(runs[ids["old"]].goodput) and runs[ids["old"]].goodput_parts == {}
    lines = render([ddp2, runs[ids["old"]]], "markdown").splitlines()
    column = [cell.strip() for cell in lines[0].split("|")].index("goodput")
    assert [[cell.strip() for cell in line.split("|")][column] for line in lines[2:]] == [
        "50%",
        "-",
    ]

    panel = scaling_figure(list(runs.values())).axes[3]
    bars = [c for c in panel.containers if len(c.patches) == len(runs)]
    assert len(bars) == len(PARTS)
    ordered = [label.get_text() for label in panel.get_xticklabels()]
    at = next(i for i, text in enumerate(ordered) if ids["ddp2"][:8] in text)
    assert sum(bar.patches[at].get_height() for bar in bars) == pytest.approx(60.0)
    old_at = next(i for i, text in enumerate(ordered) if ids["old"][:8] in text)
    assert sum(bar.patches[old_at].get_height() for bar in bars) == 0.0


def test_compare_plot_file_is_png_with_four_panels(store, tmp_path):
    uri, ids = store
    path = tmp_path / "out" / "cmp.png"
    result = CliRunner().invoke(
        main, ["compare", ids["ddp1"], ids["ddp2"], "--tracking-uri", uri, "--plot", str(path)]
    )
    assert result.exit_code == 0, result.output
    data = path.read_bytes()
    assert data[:8] == PNG
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (
        1320,
        1488,
    )  # 11 x 12.4 in at 120 dpi: the two scaling panels over the breakdown and the goodput bars
