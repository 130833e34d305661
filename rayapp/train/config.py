"""What the driver hands each worker: the spec and where its run is, pickled once per worker."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from rayapp.spec import JobSpec


@dataclass(frozen=True)
class WorkerConfig:
    spec: JobSpec
    run_id: str
    tracking_uri: str
    submitted_at: float
    """Driver wall clock at submission, for time_to_first_step_s."""
    cluster_ready_at: float = 0.0
    """Driver wall clock when the cluster was up (started or connected), for startup_workers_s."""
    fallback_path: str = ""
    """Where rank 0 writes MLflow records the tracking server could not take by the end."""
    progress: Any = None
    """A ray.util.queue.Queue that rank 0 feeds with per-epoch progress and warnings, or None."""
    mlflow_credentials: dict = field(default_factory=dict, repr=False)
    """MLFLOW_TRACKING_USERNAME/PASSWORD/TOKEN from the submitting shell, set in each worker's
    environment: a warm or remote cluster's nodes were not started with them. Never printed."""
    watchdog: Any = None
    """The driver's hang watchdog (an actor handle) every rank's heartbeat reports to, or None."""
    heartbeat_s: float = 5.0
    """Seconds between a rank's heartbeats to the watchdog."""

    def tell(self, message: str) -> None:
        """A warning for the person at the submitting terminal."""
        self.send_progress({"message": message})

    def say(self, message: str) -> None:
        """News for the person at the submitting terminal, not a warning."""
        self.send_progress({"status": message})

    def echo(self, line: str) -> None:
        """A line of the job's own output (a script's stdout) for the submitting terminal."""
        self.send_progress({"output": line})

    def send_progress(self, item: dict) -> None:
        """Best effort: a line the terminal misses (the driver gone, its queue's node lost) is no
        reason to fail training, whose figures are in MLflow anyway."""
        if self.progress is None:
            return
        try:
            self.progress.put_nowait(item)
        except Exception as exc:
            logging.getLogger(__name__).warning(
                "progress not shown at the submitting terminal: %s", exc
            )
