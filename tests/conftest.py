"""Shared fixtures. Integration tests run the real CLI against a real embedded Ray cluster
(raylets on 127.0.0.2, 127.0.0.3, ...) and a real MLflow SQLite store in a temporary directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
JOBS = REPO / "jobs"


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    if not has_cuda():
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)


def run_rayapp(*args: str, cwd: Path, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """The installed CLI in a child process, as a user would run it."""
    full_env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "rayapp", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env
    )


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


def mlflow_client(workdir: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")


def only_run(client, experiment: str = "rayapp"):
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"experiment {experiment!r} was not created"
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, f"expected one run, found {len(runs)}"
    return runs[0]
