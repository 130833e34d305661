"""Epoch metrics that never reached MLflow, logged from the job's newest checkpoint.

rank 0 writes to MLflow from a paced background thread (rayapp.outbox), so when a job ends badly
(Ctrl-C, a failure with no restarts left, a worker killed outright) its last epochs may still be
queued in a process that is gone. Every checkpoint carries the epoch metrics up to it in a small
JSON file beside the state dict; once the cluster is down, the driver logs from the newest one
the epochs MLflow lacks. They are stamped with the time of the backfill, not of the epoch.
"""

from __future__ import annotations

import json
import os
from typing import Any

HISTORY_FILE = "history.json"


def write_history(
    directory: str, *, run_id: str, epoch: int, history: list[dict[str, Any]]
) -> None:
    """Into a checkpoint being made: the run it belongs to and every epoch's metrics up to
    `epoch`."""
    with open(os.path.join(directory, HISTORY_FILE), "w", encoding="utf-8") as handle:
        json.dump({"run_id": run_id, "epoch": epoch, "history": history}, handle)


def read_history(directory: str) -> dict[str, Any]:
    """What write_history put into a checkpoint directory: run_id, epoch and history."""
    with open(os.path.join(directory, HISTORY_FILE), encoding="utf-8") as handle:
        history: dict[str, Any] = json.load(handle)
        return history


def newest_history(trial_dir: str) -> dict[str, Any] | None:
    """The history of the newest checkpoint under trial_dir (a local path or a URI Ray Train can
    store to: s3://, gs://), or None when there is none."""
    import pyarrow.fs

    try:
        filesystem, root = (
            pyarrow.fs.FileSystem.from_uri(trial_dir)
            if "://" in trial_dir
            else (pyarrow.fs.LocalFileSystem(), os.path.abspath(trial_dir))
        )
        entries = filesystem.get_file_info(pyarrow.fs.FileSelector(root, allow_not_found=True))
    except (OSError, ValueError, pyarrow.ArrowException):  # storage unreachable: nothing to go on
        return None
    newest = None
    for entry in entries:
        if entry.type != pyarrow.fs.FileType.Directory or not entry.base_name.startswith(
            "checkpoint_"
        ):
            continue
        try:
            with filesystem.open_input_stream(f"{entry.path}/{HISTORY_FILE}") as stream:
                saved = json.loads(stream.read())
        except (
            OSError,
            ValueError,
            pyarrow.ArrowException,
        ):  # no history, or a checkpoint cut short
            continue
        if newest is None or saved["epoch"] > newest["epoch"]:
            newest = saved
    return newest


def backfill_epochs(tracking_uri: str, run_id: str, trial_dir: str) -> list[int]:
    """Log the epochs of the newest checkpoint's history that the run lacks; returns those epochs.

    Raises what MLflow raises when it cannot be reached; the caller decides what to tell."""
    from mlflow.tracking import MlflowClient

    from rayapp.tracking.outbox import Record, deliver
    from rayapp.tracking.run import EPOCH_MARKER_METRIC

    saved = newest_history(trial_dir)
    if saved is None or saved.get("run_id") != run_id:
        return []
    client = MlflowClient(tracking_uri)
    logged = {metric.step for metric in client.get_metric_history(run_id, EPOCH_MARKER_METRIC)}
    missing = [epoch for epoch in range(len(saved["history"])) if epoch not in logged]
    deliver(
        client,
        [
            Record("metrics", run_id, step=epoch, values=saved["history"][epoch])
            for epoch in missing
        ],
    )
    return missing
