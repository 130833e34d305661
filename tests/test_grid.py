"""bench --grid: axes parsed, expanded and validated before anything starts (no Ray), and compare's
grouping by axis, read from real MLflow SQLite runs this test makes as a grid's children."""

from __future__ import annotations

import math

import pytest
from click.testing import CliRunner
from conftest import JOBS, migrated_store

from rayapp.cli.app import main
from rayapp.cli.submit import grid_from_options, spec_from_flags
from rayapp.driver.grid import expand, parse_axes, parse_axis, split_values
from rayapp.reports.grid import (
    TAG_AXIS_PREFIX,
    TAG_GRID_AXES,
    TAG_GRID_POINT,
    best_points,
    group_by_axis,
    load_grid_runs,
    render_grid,
)
from rayapp.spec import SpecError

SEED = str(JOBS / "seed_linear.yaml")
DIGITS = str(JOBS / "digits_mlp.yaml")


def build(job: str = SEED):
    return lambda fields: spec_from_flags(job, {}, fields=fields)


# ---- parsing ----------------------------------------------------------------------------


def test_axis_keys_are_flags_or_spec_fields():
    assert parse_axis("nodes=1,2,4").field == "cluster.nodes"
    assert parse_axis("--strategy=ddp,fsdp").field == "train.strategy"
    assert parse_axis("train.precision=fp32,bf16").field == "train.precision"
    assert parse_axis("train.pipeline.microbatches=4,8").field == "train.pipeline.microbatches"


def test_values_read_as_yaml_with_brackets_kept_whole():
    assert split_values("[64],[64, 64], 128") == ["[64]", "[64, 64]", "128"]
    axis = parse_axis("model.hidden=[64],[32,32]")
    assert axis.texts == ("[64]", "[32,32]")
    assert axis.values == ([64], [32, 32])
    assert parse_axis("nodes=1,2").values == (1, 2)
    assert parse_axis("compile=true,false").values == (True, False)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("train.stratgy=ddp,fsdp", "'train.stratgy' is not a flag or spec field; use a flag's"),
        ("nodes", "'nodes' is not accepted; use KEY=V1,V2,... e.g. nodes=1,2,4"),
        ("nodes=", "'nodes=' is not accepted; use KEY=V1,V2"),
        ("=1,2", "'=1,2' is not accepted; use KEY=V1,V2"),
        ("nodes=1,,2", "--grid nodes: '1,,2' has an empty value"),
        ("nodes=2,2", "--grid nodes: '2,2' repeats a value"),
    ],
)
def test_bad_axes_name_the_value_and_what_is_accepted(text, message):
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace(".", r"\.")):
        parse_axis(text)


def test_one_field_one_axis():
    with pytest.raises(SpecError, match="cluster.nodes is given by more than one --grid"):
        parse_axes(["nodes=1,2", "cluster.nodes=4"])


# ---- expansion and validation -------------------------------------------------------------


def test_cross_product_in_order_with_each_points_spec():
    axes = parse_axes(["nodes=1,2", "train.strategy=ddp,fsdp", "precision=fp32,bf16"])
    points = expand(axes, build())
    assert len(points) == 8
    assert [p.label for p in points[:3]] == [
        "nodes=1 train.strategy=ddp precision=fp32",
        "nodes=1 train.strategy=ddp precision=bf16",
        "nodes=1 train.strategy=fsdp precision=fp32",
    ]
    last = points[-1].spec
    assert (last.cluster.nodes, last.train.strategy, last.train.precision) == (2, "fsdp", "bf16")
    assert points[-1].tags == {
        TAG_GRID_POINT: "nodes=2 train.strategy=fsdp precision=bf16",
        TAG_GRID_AXES: "nodes,train.strategy,precision",
        TAG_AXIS_PREFIX + "nodes": "2",
        TAG_AXIS_PREFIX + "train.strategy": "fsdp",
        TAG_AXIS_PREFIX + "precision": "bf16",
    }


def test_grid_values_win_over_the_yaml_and_numbers_may_be_text():
    (point,) = expand(parse_axes(["lr=1e-3"]), build(DIGITS))
    assert point.spec.train.lr == pytest.approx(1e-3)
    points = expand(parse_axes(["model.hidden=[16],[8,8]"]), build(DIGITS))
    assert [list(p.spec.model.hidden) for p in points] == [[16], [8, 8]]


def test_a_bad_value_is_named_with_its_point_and_the_fields_choices():
    axes = parse_axes(["nodes=1,2", "precision=fp32,bf16x"])
    with pytest.raises(SpecError) as caught:
        expand(axes, build())
    assert str(caught.value) == (
        "--grid nodes=1 precision=bf16x: train.precision: 'bf16x' is not accepted; "
        "use one of: fp32, bf16, fp16"
    )


def test_settings_that_conflict_name_the_point():
    axes = parse_axes(["nodes=1,2", "strategy=ddp,pp"])
    with pytest.raises(SpecError, match=r"^--grid nodes=1 strategy=pp: train.strategy: 'pp'"):
        expand(axes, build())


def test_old_nodes_form_is_the_nodes_axis():
    (axis,) = grid_from_options((), "4,1,2")
    assert (axis.key, axis.field, axis.values) == ("nodes", "cluster.nodes", (1, 2, 4))
    axes = grid_from_options(("strategy=ddp,fsdp",), "1,2")
    assert [a.key for a in axes] == ["nodes", "strategy"]
    with pytest.raises(SpecError, match="also a --grid axis"):
        grid_from_options(("nodes=1,2",), "1,2")
    with pytest.raises(SpecError, match="nothing to vary"):
        grid_from_options((), None)
    with pytest.raises(SpecError, match="--nodes: 'x' in '1,x' is not accepted"):
        grid_from_options((), "1,x")


def test_bench_refuses_a_bad_axis_in_one_line_before_anything_starts():
    result = CliRunner().invoke(
        main, ["bench", SEED, "--grid", "nodes=1,2", "--grid", "train.precision=fp32,fp8"]
    )
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert "'fp8' is not accepted; use one of: fp32, bf16, fp16" in lines[0]


# ---- compare's grouping, from real MLflow runs ---------------------------------------------

POINTS = {  # (nodes, strategy) -> samples/s of the steady epoch, final loss
    ("1", "ddp"): (1000.0, 0.50),
    ("1", "fsdp"): (800.0, 0.40),
    ("2", "ddp"): (1900.0, 0.45),
    ("2", "fsdp"): (1500.0, 0.42),
}


@pytest.fixture
def grid_store(tmp_path):
    """A parent run and one finished child run per point, logged as bench --grid logs them."""
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    uri = migrated_store(tmp_path / "mlflow.db")
    client = MlflowClient(uri)
    experiment = client.create_experiment("rayapp")
    parent = client.create_run(experiment, tags={"rayapp.sweep": "true"}).info.run_id
    children = {}
    for (nodes, strategy), (throughput, loss) in POINTS.items():
        label = f"nodes={nodes} strategy={strategy}"
        run_id = client.create_run(
            experiment,
            tags={
                "mlflow.parentRunId": parent,
                TAG_GRID_AXES: "nodes,strategy",
                TAG_GRID_POINT: label,
                TAG_AXIS_PREFIX + "nodes": nodes,
                TAG_AXIS_PREFIX + "strategy": strategy,
            },
        ).info.run_id
        params = {"job": "seed_linear", "nodes": nodes, "world_size": nodes, "strategy": strategy}
        metrics = []
        for step, scale in enumerate((0.5, 1.0, 1.0)):  # the first epoch pays for warm-up
            metrics += [
                Metric("samples_per_s", throughput * scale, 0, step),
                Metric("epoch_time_s", 6400 / (throughput * scale), 0, step),
                Metric("loss", loss + 0.1 * (2 - step), 0, step),
            ]
        client.log_batch(
            run_id,
            metrics=metrics,
            params=[Param(k, v) for k, v in params.items()],
            tags=[RunTag("rayapp.cluster", "local")],
        )
        client.set_terminated(run_id)
        children[label] = run_id
    client.set_terminated(parent)
    return uri, parent, children


def test_grid_runs_grouped_by_each_axis_with_the_best_point(grid_store):
    uri, _parent, children = grid_store
    runs = load_grid_runs(uri, list(children.values()))
    assert {run.label for run in runs} == set(children)

    grouped = group_by_axis(runs)
    assert list(grouped) == ["nodes", "strategy"]
    by_nodes = {row.value: row for row in grouped["nodes"]}
    assert by_nodes["1"].runs == 2
    assert by_nodes["1"].means["samples_per_s"] == pytest.approx(900.0)  # steady epochs only
    assert by_nodes["2"].means["samples_per_s"] == pytest.approx(1700.0)
    by_strategy = {row.value: row for row in grouped["strategy"]}
    assert by_strategy["fsdp"].means["loss"] == pytest.approx((0.40 + 0.42) / 2)

    best = {b.metric: b for b in best_points(runs)}
    assert best["samples_per_s"].label == "nodes=2 strategy=ddp"
    assert best["samples_per_s"].run_id == children["nodes=2 strategy=ddp"]
    assert best["epoch_time_s"].label == "nodes=2 strategy=ddp"
    assert best["loss"].label == "nodes=1 strategy=fsdp"
    assert "test_accuracy" not in best  # no run logged it

    table = render_grid(runs, "table")
    assert "Grid by nodes" in table and "Grid by strategy" in table
    assert "best loss (min): nodes=1 strategy=fsdp" in table
    assert not any(math.isnan(v) for row in grouped["nodes"] for v in row.means.values())


def test_a_run_that_is_no_grid_point_is_left_out(grid_store):
    from mlflow.tracking import MlflowClient

    uri, parent, children = grid_store
    assert load_grid_runs(uri, [parent]) == []
    MlflowClient(uri).delete_tag(children["nodes=1 strategy=ddp"], TAG_AXIS_PREFIX + "strategy")
    assert len(load_grid_runs(uri, list(children.values()))) == 3


def test_compare_groups_a_grid_parent_by_axis_with_plots(grid_store, tmp_path):
    uri, parent, _children = grid_store
    plot = tmp_path / "grid.png"
    result = CliRunner().invoke(
        main,
        ["compare", "--parent", parent, "--tracking-uri", uri, "--plot", str(plot)],
    )
    assert result.exit_code == 0, result.output
    assert "Grid by nodes" in result.output and "Grid by strategy" in result.output
    assert "best samples_per_s (max): nodes=2 strategy=ddp" in result.output
    for path in (plot, tmp_path / "grid-scaling.png"):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    markdown = CliRunner().invoke(
        main, ["compare", "--parent", parent, "--tracking-uri", uri, "--format", "markdown"]
    )
    assert "**by strategy (mean over the other axes)**" in markdown.output
