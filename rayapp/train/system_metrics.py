"""Per-node system metrics in the job's run: MLflow's own monitor, on one worker per node.

Each node's local rank 0 samples its machine (CPU, memory, disk, network, and GPUs where there
are any) every tracking.system_metrics_s seconds and logs ``system/<node IP>/<metric>`` into the
run, so the MLflow UI's "System metrics" tab and `rayapp compare` show every node side by side.
One sampler per node, not per worker: the figures describe the machine, not the process.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import tenacity

from rayapp.tracking.outbox import CLIENT_ENV

MAX_UNSENT = 10_000
"""Samples' metrics kept while the store does not take them (oldest dropped first): a store down
for hours must not grow a worker's memory without bound."""
FINAL_WRITE_TRIES = 3


def preload(*, tracking_uri: str, interval_s: float) -> None:
    """Import MLflow's monitor now, at the loop's start. Imported only when the sampler starts,
    after the first collective, the import (seconds) ran on a worker node while every other rank
    waited for it; here it runs beside rank 0's own MLflow import."""
    if interval_s <= 0:
        return
    with contextlib.suppress(ImportError):  # start() says why, once
        import mlflow.system_metrics.system_metrics_monitor  # noqa: F401
        from mlflow.store.db.db_types import DATABASE_ENGINES

        # The store's module too (SQLAlchemy's: another second), which the sampler's client loads.
        if tracking_uri.partition(":")[0].partition("+")[0] in DATABASE_ENGINES:
            import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
        else:
            import mlflow.store.tracking.rest_store  # noqa: F401


def start(
    *, run_id: str, tracking_uri: str, interval_s: float, node: str, resume: bool
) -> Any | None:
    """A running monitor, or None when turned off or MLflow's monitor cannot start here."""
    if interval_s <= 0:
        return None
    # A server that went away must fail each sample's write in seconds, as rank 0's outbox does, not
    # after MLflow's default minutes of retries: stop() waits for the sampler's thread.
    os.environ.update(CLIENT_ENV)
    try:
        # MLflow announces start and stop at INFO on every node; a person needs neither.
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
        monitor = _node_sampler_class()(
            run_id,
            sampling_interval=interval_s,
            samples_before_logging=1,
            resume_logging=resume,
            node_id=node,
            tracking_uri=tracking_uri,
        )
        monitor.start()
        return monitor
    except Exception as exc:  # psutil missing, server unreachable: training goes on without it
        logging.getLogger(__name__).warning("system metrics are off on node %s: %s", node, exc)
        return None


def stop(monitor: Any | None) -> None:
    """Stop sampling and send what is left: a few tries, each bounded by the client's timeout, as
    a store busy with the other nodes' writes (SQLite's lock) or a server restarting refuses one."""
    if monitor is None:
        return
    monitor.stop_sampling()

    def send_rest() -> None:
        if monitor.mlflow_logger.data:
            monitor.mlflow_logger.flush()

    try:
        tenacity.Retrying(
            stop=tenacity.stop_after_attempt(FINAL_WRITE_TRIES),
            wait=tenacity.wait_incrementing(start=0.5, increment=0.5),
            reraise=True,
        )(send_rest)
    except Exception as exc:
        logging.getLogger(__name__).warning(
            "system metrics of node %s not written: %s", monitor.node_id, exc
        )


def _node_sampler_class() -> type:
    """MLflow's monitor with a loop that outlives a failed write. MLflow's own loop stops for good
    at the first error (a read or write refused once by a busy store), and a node's figures for
    the rest of the run are lost; here a sample that cannot be written waits for the next write."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    class NodeSampler(SystemMetricsMonitor):
        def monitor(self) -> None:
            import psutil

            # CPU % is measured between two calls in this process, and a first call has nothing to
            # measure against (psutil answers 0.0): start the clock here, and sample at the end of
            # each interval, so every sample (a short run's only one too) covers the time just
            # passed.
            psutil.cpu_percent()
            warned = False
            while not self._shutdown_event.is_set():
                self._shutdown_event.wait(self.sampling_interval)
                self.collect_metrics()
                try:
                    self.publish_metrics(self.aggregate_metrics())  # writes when its batch is due
                except Exception as exc:
                    if not warned:
                        logging.getLogger(__name__).warning(
                            "system metrics of node %s: a write failed (%s); "
                            "retrying with the next",
                            self.node_id,
                            exc,
                        )
                        warned = True
                    for monitor in self.monitors:  # the failed sample stays in the logger's batch
                        monitor.clear_metrics()
                    self._logging_step += 1
                    del self.mlflow_logger.data[:-MAX_UNSENT]

        def stop_sampling(self) -> None:
            """End the loop (at most one sampling interval away) and leave the unsent batch to
            stop()."""
            self._shutdown_event.set()
            if self._process is not None:
                self._process.join()
                self._process = None

    return NodeSampler
