"""A real 1-vs-2-node sweep on the warm cluster: parent run, two child runs, the plot
artifact."""

from __future__ import annotations

import pytest
from conftest import JOBS, mlflow_client, run_rayapp

pytestmark = pytest.mark.integration


def test_sweep_one_and_two_nodes(workdir, warm_cluster):
    result = run_rayapp(
        "bench",
        str(JOBS / "seed_linear.yaml"),
        "--nodes",
        "1,2",
        "--epochs",
        "2",
        cwd=workdir,
        env=warm_cluster,
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert "efficiency" in result.stdout

    client = mlflow_client(workdir)
    experiment = client.get_experiment_by_name("rayapp")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("rayapp.sweep") == "true"]
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(int(c.data.params["nodes"]) for c in children) == [1, 2]
    assert all(c.info.status == "FINISHED" for c in children)

    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"scaling.png", "scaling.csv", "scaling.md", "scaling.json"} <= artifacts
    assert "time_breakdown.png" in artifacts
    local_png = client.download_artifacts(parent.info.run_id, "scaling.png", str(workdir))
    with open(local_png, "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    assert 0 < parent.data.metrics["efficiency_at_largest"] <= 2.5
