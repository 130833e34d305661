"""compare's arithmetic on runs with known metric values, logged by the test into a real MLflow
SQLite store."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner
from conftest import migrated_store

from rayapp.cli import main
from rayapp.reports.compare import load_summaries
from rayapp.reports.compare_table import render
from rayapp.reports.plot import scaling_plot
from rayapp.tracking.logger import RunLogger
from rayapp.tracking.run import close_run, open_run


def log_run(
    uri: str,
    *,
    job: str,
    world: int | str,
    scaling: str,
    epochs: list[dict],
    experiment: str = "cmp",
) -> str:
    """world: a fixed size, or an elastic run's "MIN:MAX" as rayapp logs it in `nodes` and
    `world_size`."""
    params = {
        "job": job,
        "nodes": str(world),
        "world_size": str(world),
        "workers_per_node": "1",
        "backend": "gloo",
        "strategy": "ddp",
        "scaling": scaling,
    }
    run_id = open_run(
        tracking_uri=uri, experiment=experiment, run_name=f"{job}-{world}", params=params, tags={}
    )
    logger = RunLogger(uri, run_id, fallback_path=f"/nonexistent/{run_id}.jsonl")
    for epoch, metrics in enumerate(epochs):
        logger.log_epoch(epoch, metrics)
    logger.log_metrics(
        {"param_bytes_per_rank": 4 * 2**20 / int(str(world).split(":")[-1])}, step=len(epochs) - 1
    )
    assert logger.close() is None  # all delivered: no fallback file
    close_run(uri, run_id, "FINISHED")
    return run_id


def epochs(time_s: float, samples_per_s: float, comm_s: float, n: int = 4) -> list[dict]:
    # The first epoch is deliberately slow: compare must exclude it as warm-up.
    first = {
        "epoch_time_s": 10 * time_s,
        "samples_per_s": samples_per_s / 10,
        "comm_time_s": 0.0,
        "peak_mem_mb": 100.0,
    }
    steady = {
        "epoch_time_s": time_s,
        "samples_per_s": samples_per_s,
        "comm_time_s": comm_s,
        "peak_mem_mb": 120.0,
    }
    return [first] + [steady] * (n - 1)


@pytest.fixture
def store(tmp_path):
    uri = migrated_store(tmp_path / "mlflow.db")
    ids = {
        "strong1": log_run(
            uri, job="mlp", world=1, scaling="strong", epochs=epochs(2.0, 1000.0, 0.0)
        ),
        "strong2": log_run(
            uri, job="mlp", world=2, scaling="strong", epochs=epochs(1.25, 1600.0, 0.25)
        ),
        "strong4": log_run(
            uri, job="mlp", world=4, scaling="strong", epochs=epochs(0.8, 2500.0, 0.4)
        ),
        "weak1": log_run(uri, job="seed", world=1, scaling="weak", epochs=epochs(1.0, 500.0, 0.0)),
        "weak2": log_run(uri, job="seed", world=2, scaling="weak", epochs=epochs(1.25, 800.0, 0.5)),
    }
    return uri, ids


def by_world(summaries, job):
    return {s.world_size: s for s in summaries if s.job == job}


def test_speedup_efficiency_and_ideals(store):
    uri, _ = store
    summaries = load_summaries(uri, experiment="cmp")
    strong = by_world(summaries, "mlp")
    assert strong[1].epoch_time_s == 2.0  # median of steady epochs; warm-up excluded
    assert strong[2].speedup == pytest.approx(1.6)
    assert strong[2].efficiency == pytest.approx(0.8)
    assert strong[4].speedup == pytest.approx(2.5)
    assert strong[4].efficiency == pytest.approx(0.625)
    assert strong[4].ideal_epoch_s == pytest.approx(0.5)  # 2.0 * 1/4
    assert strong[4].article_epoch_s == pytest.approx(0.5)
    assert strong[2].comm_share == pytest.approx(0.2)
    assert strong[1].peak_mem_mb == 120.0
    assert strong[4].param_bytes_per_rank == pytest.approx(2**20)

    weak = by_world(summaries, "seed")  # its own group: baseline is seed at world 1, not mlp
    assert weak[2].speedup == pytest.approx(1.6)
    assert weak[2].efficiency == pytest.approx(0.8)
    assert weak[2].ideal_epoch_s == pytest.approx(1.0)  # weak scaling: flat
    assert weak[2].article_epoch_s == pytest.approx(
        0.5
    )  # the article's halving, which weak scaling cannot meet
    assert weak[2].comm_share == pytest.approx(0.4)


def test_compare_named_runs_and_formats(store):
    uri, ids = store
    runner = CliRunner()
    result = runner.invoke(
        main, ["compare", ids["strong1"], ids["strong4"], "--tracking-uri", uri, "--format", "json"]
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [r["world_size"] for r in rows] == [1, 4]
    assert rows[1]["efficiency"] == pytest.approx(0.625)

    csv_out = runner.invoke(
        main, ["compare", "--experiment", "cmp", "--tracking-uri", uri, "--format", "csv"]
    ).output
    assert csv_out.splitlines()[0].startswith("job,nodes,world_size")
    assert len(csv_out.strip().splitlines()) == 6

    markdown = runner.invoke(
        main, ["compare", "--experiment", "cmp", "--tracking-uri", uri, "--format", "markdown"]
    ).output
    assert "| 62% |" in markdown or "| 63% |" in markdown

    table = runner.invoke(main, ["compare", "--experiment", "cmp", "--tracking-uri", uri]).output
    assert "efficiency" in table and "article s" in table


def test_compare_bad_run_id_is_one_line(store):
    uri, _ = store
    result = CliRunner().invoke(main, ["compare", "nope", "--tracking-uri", uri])
    assert result.exit_code == 1
    assert "run 'nope' does not exist" in result.output


def test_plot_is_written(store, tmp_path):
    uri, _ = store
    path = scaling_plot(load_summaries(uri, experiment="cmp"), tmp_path / "plot.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_render_marks_unmeasured_as_dash(store):
    uri, _ = store
    summaries = load_summaries(uri, experiment="cmp")
    from dataclasses import replace

    text = render([replace(summaries[0], comm_share=math.nan)], "markdown")
    assert "| - |" in text


def test_an_elastic_run_is_compared_with_no_fixed_size(store):
    uri, ids = store
    # same job, scaling and strategy as weak1/weak2, but its world size changed while it ran
    elastic = log_run(uri, job="seed", world="1:2", scaling="weak", epochs=epochs(0.5, 5000.0, 0.1))
    summaries = load_summaries(uri, experiment="cmp")
    (summary,) = [s for s in summaries if s.run_id == elastic]
    assert (summary.elastic, summary.nodes_label, summary.world_label) == (True, "1:2", "1:2")
    assert math.isnan(summary.speedup) and math.isnan(summary.efficiency)
    # the fixed runs keep their own baseline: weak1, not the elastic run's faster, smaller minimum
    weak = {s.world_size: s for s in summaries if s.job == "seed" and not s.elastic}
    assert weak[2].speedup == pytest.approx(1.6)

    (row,) = [row for row in csv_rows(runner_output(uri, "csv")) if row["nodes"] == "1:2"]
    assert (row["job"], row["world_size"], row["efficiency"]) == (
        "seed",
        "1:2",
        "nan",
    )  # unmeasured, as pandas reads it
    markdown = runner_output(uri, "markdown")
    (line,) = [line for line in markdown.splitlines() if line.startswith("| seed | 1:2 |")]
    assert "| - |" in line  # no efficiency
    assert "elastic run" in runner_output(uri, "table")
    assert "elastic run" not in render([s for s in summaries if not s.elastic], "table")


def runner_output(uri: str, fmt: str) -> str:
    result = CliRunner().invoke(
        main, ["compare", "--experiment", "cmp", "--tracking-uri", uri, "--format", fmt]
    )
    assert result.exit_code == 0, result.output
    return result.output


def csv_rows(text: str) -> list[dict]:
    import csv
    import io

    return list(csv.DictReader(io.StringIO(text)))
