"""Per-node system metrics in the job's run: MLflow's own monitor, on one worker per node.

Each node's local rank 0 samples its machine (CPU, memory, disk, network, and GPUs where there
are any) every tracking.system_metrics_s seconds and logs ``system/<node IP>/<metric>`` into the
run, so the MLflow UI's "System metrics" tab and `rayapp compare` show every node side by side.
One sampler per node, not per worker: the figures describe the machine, not the process.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from rayapp.tracking.outbox import CLIENT_ENV


def start(*, run_id: str, tracking_uri: str, interval_s: float, node: str, resume: bool) -> Optional[Any]:
    """A running monitor, or None when turned off or MLflow's monitor cannot start here."""
    if interval_s <= 0:
        return None
    # A server that went away must fail each sample's write in seconds, as rank 0's outbox does, not
    # after MLflow's default minutes of retries: finish() waits for the sampler's thread.
    os.environ.update(CLIENT_ENV)
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        # MLflow announces start and stop at INFO on every node; a person needs neither.
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
        monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s, samples_before_logging=1,
                                       resume_logging=resume, node_id=node, tracking_uri=tracking_uri)
        monitor.start()
        return monitor
    except Exception as exc:  # psutil missing, server unreachable: training goes on without it
        logging.getLogger(__name__).warning("system metrics are off on node %s: %s", node, exc)
        return None


def stop(monitor: Optional[Any]) -> None:
    """Stop sampling and send what is left (bounded: the monitor's own client times out)."""
    if monitor is not None:
        try:
            monitor.finish()
        except Exception:  # the run's figures so far are already logged
            pass
