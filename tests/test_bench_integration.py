"""A real 2 x 2 grid on the warm cluster (nodes 1,2 x strategy ddp,fsdp, 1 epoch each): one parent
run, one child run per point tagged with it, the scaling and grid artifacts on the parent, and
compare's grouping by each axis. (The older `--nodes 1,2` form runs in test_ui_browser.py.)"""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from conftest import JOBS, mlflow_client, run_rayapp

from rayapp.cli.app import main

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_grid_of_nodes_and_strategies(workdir, warm_cluster):
    result = run_rayapp(
        "bench",
        str(JOBS / "seed_linear.yaml"),
        "--grid",
        "nodes=1,2",
        "--grid",
        "train.strategy=ddp,fsdp",
        "--epochs",
        "1",
        cwd=workdir,
        env=warm_cluster,
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert "efficiency" in result.stdout
    assert "Grid by nodes" in result.stdout and "Grid by train.strategy" in result.stdout

    client = mlflow_client(workdir)
    experiment = client.get_experiment_by_name("rayapp")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("rayapp.sweep") == "true"]
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    assert parent.data.params["grid.nodes"] == "1,2"
    assert parent.data.params["grid.train.strategy"] == "ddp,fsdp"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    points = sorted((c.data.params["nodes"], c.data.params["strategy"]) for c in children)
    assert points == [("1", "ddp"), ("1", "fsdp"), ("2", "ddp"), ("2", "fsdp")]
    assert all(c.info.status == "FINISHED" for c in children)
    for child in children:  # each child tagged with its own point
        tags = child.data.tags
        assert tags["rayapp.grid.nodes"] == child.data.params["nodes"]
        assert tags["rayapp.grid.train.strategy"] == child.data.params["strategy"]
    labels = {c.data.tags["rayapp.grid_point"]: c.info.run_id for c in children}
    best = parent.data.tags["rayapp.best.samples_per_s"]
    assert best.rsplit(" (", 1)[0] in labels, best

    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"scaling.png", "scaling.csv", "scaling.md", "scaling.json"} <= artifacts
    assert {"time_breakdown.png", "grid.png", "grid.md", "grid.csv", "grid.json"} <= artifacts
    local_png = client.download_artifacts(parent.info.run_id, "grid.png", str(workdir))
    with open(local_png, "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    assert 0 < parent.data.metrics["efficiency_at_largest"] <= 2.5

    compared = CliRunner().invoke(  # in this process: no second interpreter to start
        main,
        [
            "compare",
            "--parent",
            parent.info.run_id,
            "--tracking-uri",
            f"sqlite:///{workdir / 'mlflow.db'}",
            "--plot",
            str(workdir / "grouped.png"),
        ],
    )
    assert compared.exit_code == 0, compared.output[-3000:]
    for line in ("Grid by nodes", "Grid by train.strategy", "best samples_per_s (max): "):
        assert line in compared.output, compared.output
    assert (workdir / "grouped.png").exists() and (workdir / "grouped-scaling.png").exists()
